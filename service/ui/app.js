// The console's entry point: the session, sign-in, and which page the address shows.
import { ApiError, Stream, get, loadSession, num, session, signIn, signOut } from "./api.js";
import { ago, h, runLink, statusBadge, when } from "./dom.js";
import { fmt } from "./charts.js";
import { RunPage } from "./run.js";

const app = document.getElementById("app");
let current = null; // the page shown: has close()

function show(...nodes) {
  app.replaceChildren(...nodes);
}

function closePage() {
  if (current && current.close) current.close();
  current = null;
}

// -- runs ----------------------------------------------------------------------------------------
class RunsPage {
  constructor() {
    this.body = h("tbody");
    show(h("h1", {}, "Runs"),
      h("table", { class: "runs", id: "runs" },
        h("thead", {}, h("tr", {}, ["run", "job", "status", "step", "reports", "last report", "loss", "grad norm", "tokens/s", "paused / LR ×", "firing alerts"].map((t) => h("th", {}, t)))),
        this.body),
      h("p", { class: "muted", id: "runs-empty" }, "No run has registered yet."));
    this.stream = new Stream(() => "/ui/api/stream", { runs: (runs) => this.render(runs) });
  }

  render(runs) {
    document.getElementById("runs-empty").hidden = runs.length > 0;
    this.body.replaceChildren(...runs.map((r) => h("tr", { dataset: { run: r.run } },
      h("td", {}, runLink(r.run)), h("td", {}, r.job), h("td", {}, statusBadge(r.status)),
      h("td", { class: "num" }, r.last_step ?? "–"), h("td", { class: "num" }, r.reports),
      h("td", {}, ago(r.last_report_at)),
      h("td", { class: "num" }, fmt(num(r.health.trainguard_loss))),
      h("td", { class: "num" }, fmt(num(r.health.trainguard_grad_norm))),
      h("td", { class: "num" }, fmt(num(r.health.trainguard_tokens_per_second))),
      h("td", {}, `${r.desired.paused ? "paused" : "–"} / ${fmt(r.desired.lr_scale)}`),
      h("td", {}, r.firing.length ? r.firing.map((a) => h("span", { class: `badge sev-${a.severity}`, title: a.summary }, a.rule)) : "none"))));
  }

  close() { this.stream.close(); }
}

// -- audit log -------------------------------------------------------------------------------------
class AuditPage {
  constructor() {
    this.body = h("tbody");
    this.newest = 0;
    this.more = h("button", { type: "button", onclick: () => this.page(this.before) }, "Older events");
    show(h("h1", {}, "Audit log"),
      h("p", { class: "muted" }, "Every change of desired state, alert, resolution and acknowledgement, newest first."),
      h("table", { class: "events", id: "audit" },
        h("thead", {}, h("tr", {}, ["#", "time", "run", "kind", "generation", "actor", "what"].map((t) => h("th", {}, t)))), this.body),
      this.more);
    this.page(null).then(() => {
      if (this.closed) return;
      this.stream = new Stream(() => `/ui/api/stream?after=${this.newest}`, {
        audit: (ev) => { if (ev.id > this.newest) { this.newest = ev.id; this.body.prepend(this.row(ev)); } },
      });
    }, (err) => {
      if (err instanceof ApiError && err.status === 401) showSignIn();
      else show(h("p", { class: "error" }, err.message));
    });
  }

  async page(before) {
    const q = before ? `?before=${before}` : "";
    const { events, before: older } = await get(`/ui/api/events${q}`);
    if (!before && events.length) this.newest = events[0].id;
    this.body.append(...events.map((ev) => this.row(ev)));
    this.before = older;
    this.more.hidden = !older;
  }

  row(ev) {
    return h("tr", { dataset: { kind: ev.kind, id: ev.id } },
      h("td", { class: "num" }, ev.id), h("td", {}, when(ev.time)), h("td", {}, runLink(ev.run)),
      h("td", {}, h("span", { class: `badge kind-${ev.kind}` }, ev.kind)), h("td", { class: "num" }, ev.generation ?? "–"),
      h("td", {}, ev.actor), h("td", {}, ev.reason));
  }

  close() {
    this.closed = true;
    if (this.stream) this.stream.close();
  }
}

// -- sign-in and routing -----------------------------------------------------------------------------
function showSignIn() {
  closePage();
  app.replaceChildren();
  document.getElementById("signin").hidden = false;
  document.getElementById("signin-token").focus();
}

function renderWho() {
  const who = document.getElementById("who");
  who.textContent = session.signedIn ? `${session.actor} · ${session.scopes.join(", ")}` : "";
  document.getElementById("signout").hidden = !(session.signedIn && session.authRequired);
}

function route() {
  closePage();
  document.getElementById("signin").hidden = true;
  const path = location.pathname.replace(/\/+$/, "");
  const m = path.match(/^\/ui\/runs\/(.+)$/);
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", false);
  if (m) {
    current = new RunPage(app, decodeURIComponent(m[1]), { onAuth: showSignIn });
  } else if (path === "/ui/audit") {
    document.querySelector('[data-nav="audit"]').classList.add("active");
    current = new AuditPage();
  } else {
    document.querySelector('[data-nav="runs"]').classList.add("active");
    current = new RunsPage();
  }
}

async function start() {
  document.addEventListener("click", (e) => {
    const a = e.target.closest("a[data-link], nav a[data-nav]");
    if (!a || e.ctrlKey || e.metaKey || e.shiftKey || e.button !== 0) return;
    e.preventDefault();
    history.pushState(null, "", a.getAttribute("href"));
    route();
  });
  window.addEventListener("popstate", route);
  document.getElementById("signin-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const input = document.getElementById("signin-token");
    const error = document.getElementById("signin-error");
    error.textContent = "";
    try {
      await signIn(input.value.trim());
      input.value = "";
      renderWho();
      route();
    } catch (err) {
      error.textContent = err instanceof ApiError ? err.message : "cannot reach the controller";
    }
  });
  document.getElementById("signout").addEventListener("click", async () => {
    await signOut();
    renderWho();
    showSignIn();
  });
  try {
    await loadSession();
  } catch (err) {
    show(h("p", { class: "error" }, `Cannot reach the controller: ${err.message}`));
    return;
  }
  renderWho();
  if (!session.signedIn) showSignIn();
  else route();
}

start();
