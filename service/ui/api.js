// Talking to the controller: the session (cookie + CSRF token), JSON requests, event streams.
// The operator token is sent once, to /ui/login, and never kept: the HttpOnly session cookie
// authorises every later request and the CSRF token (kept in memory only) every action.

export class ApiError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

export const session = { signedIn: false, authRequired: false, scopes: [], csrf: "", actor: "" };

function adopt(body) {
  session.signedIn = !!body.signed_in;
  session.authRequired = !!body.auth_required;
  session.scopes = body.scopes || [];
  session.csrf = body.csrf || "";
  session.actor = body.actor || "";
  return session;
}

export const can = (scope) => session.scopes.includes(scope);

async function answer(resp) {
  const text = await resp.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch { body = { detail: text }; }
  if (!resp.ok) {
    const detail = body && body.detail !== undefined ? (typeof body.detail === "string" ? body.detail : JSON.stringify(body.detail)) : resp.statusText;
    throw new ApiError(resp.status, detail);
  }
  return body;
}

export async function loadSession() {
  return adopt(await answer(await fetch("/ui/api/session", { credentials: "same-origin" })));
}

export async function signIn(token) {
  return adopt(await answer(await fetch("/ui/login", {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json" }, body: JSON.stringify({ token }),
  })));
}

export async function signOut() {
  await answer(await fetch("/ui/logout", { method: "POST", credentials: "same-origin", headers: { "X-CSRF-Token": session.csrf } }));
  adopt({ signed_in: false, auth_required: true });
}

export async function get(path) {
  return answer(await fetch(path, { credentials: "same-origin" }));
}

// A state-changing request: a JSON body and the session's CSRF token.
async function change(method, path, body) {
  return answer(await fetch(path, {
    method, credentials: "same-origin",
    headers: { "Content-Type": "application/json", "X-CSRF-Token": session.csrf },
    body: JSON.stringify(body || {}),
  }));
}

export const post = (path, body) => change("POST", path, body);
export const del = (path, body) => change("DELETE", path, body);

// The wire writes NaN and infinities as strings: back to numbers.
export function num(v) {
  if (v === "NaN") return NaN;
  if (v === "Infinity") return Infinity;
  if (v === "-Infinity") return -Infinity;
  return v;
}

// An EventSource that reconnects from the caller's cursors (url() is called on every connect);
// onDrop() is called each time the connection fails or ends.
export class Stream {
  constructor(url, handlers, onDrop) {
    this.url = url;
    this.handlers = handlers;
    this.onDrop = onDrop;
    this.closed = false;
    this.delay = 1000;
    this.open();
  }

  open() {
    if (this.closed) return;
    const es = this.es = new EventSource(this.url(), { withCredentials: true });
    for (const [kind, fn] of Object.entries(this.handlers)) {
      es.addEventListener(kind, (e) => { this.delay = 1000; fn(JSON.parse(e.data)); });
    }
    es.onerror = () => {
      es.close();
      if (this.closed) return;
      if (this.onDrop) this.onDrop();
      // a stream refused because the session ended: back to the sign-in page
      loadSession().then((s) => { if (!s.signedIn) location.reload(); }, () => {});
      setTimeout(() => this.open(), this.delay);
      this.delay = Math.min(this.delay * 2, 15000);
    };
  }

  close() {
    this.closed = true;
    if (this.es) this.es.close();
  }
}
