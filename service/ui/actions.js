// A run's actions, built from the controller's command list (GET /ui/api/commands): one button per
// command the operator's scopes allow, its body's fields as inputs of the confirmation dialog (a
// number input with the bounds, a select for choices, a comma-separated text for lists), what it
// would change as the controller computes it (…/preview) before it is sent, and the answer: the
// generation sent and the step every rank applied it at, or the controller's message (409, 422).
import { ApiError, can, get, post } from "./api.js";
import { h } from "./dom.js";

let listing = null;

// The commands, loaded once per page load (again after a failure).
export function loadCommands() {
  if (!listing) listing = get("/ui/api/commands").catch((err) => { listing = null; throw err; });
  return listing;
}

// "lr_scale" -> "LR scale…": words of two letters are initials; "…" when the dialog asks for values.
export function label(cmd) {
  const words = cmd.name.split("_").map((w, i) => (w.length <= 2 ? w.toUpperCase() : i === 0 ? w[0].toUpperCase() + w.slice(1) : w));
  return words.join(" ") + (cmd.fields.length ? "…" : "");
}

function bounds(f) {
  const lo = f.exclusive_minimum ?? f.minimum, hi = f.exclusive_maximum ?? f.maximum;
  if (lo === null && hi === null) return "";
  const left = f.exclusive_minimum !== null || lo === null ? "(" : "[";
  const right = f.exclusive_maximum !== null || hi === null ? ")" : "]";
  return `in ${left}${lo ?? "-∞"}, ${hi ?? "∞"}${right}`;
}

// The input of one field of a command's body, and how its value is read back.
function fieldInput(f) {
  const attrs = { id: `confirm-field-${f.name}`, name: f.name, required: f.required ? true : null };
  let input;
  if (f.type === "choice") {
    input = h("select", attrs, f.choices.map((c) => h("option", { value: c, selected: c === f.default ? true : null }, c)));
  } else if (f.type === "boolean") {
    input = h("input", { ...attrs, type: "checkbox", checked: f.default ? true : null });
  } else if (f.type === "number" || f.type === "integer") {
    input = h("input", { ...attrs, type: "number", step: f.type === "integer" ? "1" : "any", min: f.minimum, max: f.maximum, value: f.default });
  } else {
    const value = f.type === "list" ? (f.default || []).join(",") : f.default;
    input = h("input", { ...attrs, type: "text", value: value || null, maxlength: f.max_length });
  }
  const hint = [f.description, bounds(f), f.type === "list" ? "comma-separated; empty: all" : "", f.required ? "required" : ""].filter(Boolean).join(" · ");
  const read = () => {
    if (f.type === "boolean") return input.checked;
    const raw = input.value.trim();
    if (raw === "") return undefined;
    if (f.type === "number" || f.type === "integer") return Number(raw);
    if (f.type === "list") return raw.split(",").map((s) => s.trim()).filter(Boolean);
    return raw;
  };
  const el = h("label", { dataset: { field: f.name } }, `${f.name.replaceAll("_", " ")} `, hint ? h("span", { class: "muted" }, `(${hint})`) : null, input);
  return { el, input, read, name: f.name };
}

export class Actions {
  constructor(el, result, run, { onAuth }) {
    this.el = el;
    this.result = result;
    this.run = run;
    this.onAuth = onAuth;
    this.commands = [];
    this.detail = null;
    this.pending = null; // {command, generation, done}
    this.sending = false;
    loadCommands().then((list) => { this.commands = list; this.render(); }, (err) => {
      if (err instanceof ApiError && err.status === 401) this.onAuth();
      else this.setResult("error", `the actions could not be loaded: ${err.message}`);
    });
  }

  update(detail) {
    this.detail = detail;
    this.render();
    this.checkPending();
  }

  render() {
    const allowed = this.commands.filter((c) => can(c.scope));
    if (!allowed.length || !this.detail) { this.el.replaceChildren(); this.el.hidden = true; return; }
    const button = (c) => h("button", { type: "button", class: c.dangerous ? "danger" : "", dataset: { action: c.url, kind: c.kind },
      title: c.summary, disabled: this.sending ? true : null, onclick: () => this.confirm(c) }, label(c));
    const control = allowed.filter((c) => c.kind !== "diagnostic"), diagnostic = allowed.filter((c) => c.kind === "diagnostic");
    this.el.hidden = false;
    this.el.replaceChildren(...control.map(button),
      ...(diagnostic.length ? [h("span", { class: "actions-group muted" }, "diagnostics:")] : []), ...diagnostic.map(button));
  }

  path(cmd, suffix = "") {
    return `/ui/api/runs/${encodeURIComponent(this.run)}/${cmd.url}${suffix}`;
  }

  // What the command would change now, as the controller computes it; its refusal in the note.
  async preview(cmd, body) {
    const seq = this.previewSeq = (this.previewSeq || 0) + 1;
    const note = document.getElementById("confirm-note");
    let rows = [], text = "", state = "";
    try {
      const res = await post(this.path(cmd, "/preview"), body);
      rows = res.changes.map((c) => h("tr", { dataset: { field: c.field } }, h("td", {}, c.field), h("td", {}, String(c.now)), h("td", {}, String(c.after))));
      text = res.note || (res.changes.length ? "" : "Nothing changes: the run is already in that state.");
      if (res.applies === "when_registered_again") text = `The run finished: this applies when a job registers run ${this.run} again. ${text}`;
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return this.onAuth();
      text = `${err.message} (HTTP ${err.status || "?"})`;
      state = "error";
    }
    if (seq !== this.previewSeq) return; // a newer preview is on its way
    document.getElementById("confirm-changes").replaceChildren(...rows);
    note.textContent = text;
    note.dataset.state = state;
  }

  async confirm(cmd) {
    const dialog = document.getElementById("confirm");
    const inputs = cmd.fields.map(fieldInput);
    // A finished run refuses a command unless it is queued for a job that registers the run again.
    if (this.detail && this.detail.status === "finished") {
      inputs.push(fieldInput({ name: "on_restart", type: "boolean", default: false, minimum: null, maximum: null,
        exclusive_minimum: null, exclusive_maximum: null,
        description: `the run finished: apply it when a job registers run ${this.run} again (restarted from a checkpoint)` }));
    }
    const body = () => {
      const out = { reason: document.getElementById("confirm-reason").value };
      for (const i of inputs) { const v = i.read(); if (v !== undefined) out[i.name] = v; }
      return out;
    };
    document.getElementById("confirm-title").textContent = `${label(cmd).replace("…", "")}: run ${this.run}?`;
    document.getElementById("confirm-body").textContent = cmd.summary + (cmd.dangerous ? ". This cannot be undone by another command." : "");
    document.getElementById("confirm-fields").replaceChildren(...inputs.map((i) => i.el));
    document.getElementById("confirm-reason").value = "";
    document.getElementById("confirm-ok").className = cmd.dangerous ? "danger" : "";
    dialog.dataset.command = cmd.url;
    let timer = null;
    document.getElementById("confirm-fields").oninput = () => {
      clearTimeout(timer);
      timer = setTimeout(() => this.preview(cmd, body()), 150);
    };
    await this.preview(cmd, body()); // the changes are on screen when the dialog opens
    dialog.returnValue = "";
    dialog.onclose = () => {
      clearTimeout(timer);
      if (dialog.returnValue === "ok") this.send(cmd, body());
    };
    dialog.showModal();
  }

  async send(cmd, body) {
    const name = cmd.url;
    this.setResult("sending", `${name}: sending…`);
    this.pending = { command: name, generation: null, done: false };
    this.sending = true; // the buttons wait for the answer, not for the acknowledgement
    this.render();
    try {
      const res = await post(this.path(cmd), body);
      if (!res.changed) {
        this.pending.done = true;
        this.setResult("unchanged", `${name}: the run is already in that state (no new generation).`);
      } else if (res.applies === "when_registered_again") {
        this.pending.done = true; // no rank runs to apply it now
        this.setResult("queued", `${name} queued as generation ${res.desired.generation}: the run finished; it applies when a job registers run ${this.run} again.`);
      } else {
        this.pending.generation = res.desired.generation;
        this.setResult("pending", `${name} sent as generation ${res.desired.generation}; waiting for every rank to apply it…`);
      }
    } catch (err) {
      this.pending.done = true;
      if (err instanceof ApiError && err.status === 401) return this.onAuth();
      this.setResult("error", `${name} refused: ${err.message} (HTTP ${err.status || "?"})`);
    } finally {
      this.sending = false;
    }
    this.render();
    this.checkPending();
  }

  checkPending() {
    const p = this.pending, d = this.detail;
    if (!p || p.done || p.generation === null || !d) return;
    if (d.applied_generation >= p.generation && d.applied_step !== null) {
      p.done = true;
      this.setResult("applied", `${p.command} applied at step ${d.applied_step} on every rank (generation ${d.applied_generation}).`, d.applied_step);
    }
  }

  setResult(state, text, step) {
    this.result.dataset.state = state;
    if (step !== undefined) this.result.dataset.step = String(step); else delete this.result.dataset.step;
    this.result.textContent = text;
  }
}
