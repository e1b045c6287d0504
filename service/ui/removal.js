// Deleting a run from its page (DELETE /ui/api/runs/{run}, the command scope): a confirmation that
// names the run; a live run is refused by the controller (409) and the confirmation comes back with
// the controller's reason and a forced delete that needs a reason for the audit log.
import { ApiError, can, del, session } from "./api.js";
import { h } from "./dom.js";

export class Removal {
  // onDeleted({actor, reason, time}) once the controller deleted the run; onResult(state, text) for a refusal.
  constructor(run, { onDeleted, onResult, onAuth }) {
    this.run = run;
    this.onDeleted = onDeleted;
    this.onResult = onResult;
    this.onAuth = onAuth;
    this.button = can("command")
      ? h("button", { type: "button", class: "danger", id: "delete-run", onclick: () => this.confirm(null) }, "Delete run…")
      : null;
  }

  // The confirmation: plain, or after the controller's refusal (its reason) for a forced delete.
  confirm(refusal) {
    const dialog = document.getElementById("delete-confirm");
    const reason = document.getElementById("delete-reason");
    const note = document.getElementById("delete-refusal");
    document.getElementById("delete-title").textContent = refusal ? `Delete run ${this.run} anyway?` : `Delete run ${this.run}?`;
    note.textContent = refusal ? `The controller refused: ${refusal}` : "";
    note.hidden = !refusal;
    reason.required = !!refusal;
    if (!refusal) reason.value = "";
    document.getElementById("delete-ok").textContent = refusal ? "Delete anyway" : "Delete";
    dialog.dataset.force = refusal ? "true" : "false";
    dialog.returnValue = "";
    dialog.onclose = () => {
      if (dialog.returnValue === "ok") this.send(!!refusal, reason.value.trim());
    };
    dialog.showModal();
  }

  async send(force, reason) {
    if (this.button) this.button.disabled = true;
    this.onResult("sending", `delete: sending…`);
    try {
      await del(`/ui/api/runs/${encodeURIComponent(this.run)}`, { force, reason });
      this.onDeleted({ actor: session.actor, reason: reason || `deleted from the console by ${session.actor}`, time: Date.now() / 1000 });
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return this.onAuth();
      if (err instanceof ApiError && err.status === 409 && !force) {
        this.onResult("refused", `delete refused: ${err.message} (HTTP 409)`);
        this.confirm(err.message);
      } else {
        this.onResult("error", `delete refused: ${err.message} (HTTP ${err.status || "?"})`);
      }
    } finally {
      if (this.button) this.button.disabled = false;
    }
  }
}
