// One run: status, actions, alerts with their diagnoses, the incidents of the automatic recovery
// (onset, rungs, outcome), its pre-flight checks, live charts of the controller's window (updated over the event stream),
// the per-rank view and the run's audit log; deleting the run, and saying so when it is deleted.
import { Actions } from "./actions.js";
import { ApiError, Stream, get, num } from "./api.js";
import { Chart, fmt } from "./charts.js";
import { h, statusBadge, when } from "./dom.js";
import { preflightSection } from "./preflight.js";
import { Removal } from "./removal.js";

// Job-level charts: the report values they draw (the agent's metric names).
const CHARTS = [
  { id: "loss", title: "Loss", series: [{ key: "trainguard_loss", label: "loss" }] },
  { id: "grad_norm", title: "Gradient norm (before clipping)", series: [
    { key: "trainguard_grad_norm", label: "at the report" }, { key: "trainguard_grad_norm_max", label: "largest since the last report" }] },
  { id: "update_ratio", title: "Update ratio ‖ΔW‖ / ‖W‖ (log)", log: true, series: [{ key: "trainguard_update_ratio", label: "update ratio" }] },
  { id: "effective_lr", title: "Effective learning rate ‖ΔW‖ / ‖g‖ (log)", log: true, series: [{ key: "trainguard_effective_lr", label: "effective LR" }] },
  { id: "lr_scale", title: "LR multiplier (lr_scale)", series: [{ key: "trainguard_lr_scale", label: "lr_scale" }] },
  { id: "step_time", title: "Step time (s)", series: [{ key: "trainguard_step_duration_seconds", label: "step time" }] },
  { id: "tokens_per_second", title: "Tokens per second", series: [{ key: "trainguard_tokens_per_second", label: "tokens/s" }] },
  { id: "data_duplicates", title: "Data: duplicated sequences (ratio)", series: [
    { key: "trainguard_data_duplicate_ratio", label: "exact" }, { key: "trainguard_data_near_duplicate_ratio", label: "near" }] },
  { id: "data_kl", title: "Data: token distribution shift (KL)", series: [{ key: "trainguard_data_token_kl_divergence", label: "KL" }] },
  { id: "data_special", title: "Data: control and special tokens (ratio)", series: [{ key: "trainguard_data_special_token_ratio", label: "ratio" }] },
  { id: "data_length", title: "Data: length shift (p-value)", series: [{ key: "trainguard_data_length_shift_pvalue", label: "p-value" }] },
];
// Per-rank vectors the leader gathers with every report.
const RANK_CHARTS = [
  { id: "rank_step_time", vector: "step_time_s", title: "Step time per rank (s)" },
  { id: "rank_grad_norm", vector: "grad_norm", title: "Gradient norm per rank" },
  { id: "rank_loss", vector: "loss", title: "Loss per rank" },
];
const RANK_COLUMNS = ["step_time_s", "loss", "grad_norm", "grad_fingerprint", "param_fingerprint"];

// The median of the finite values `sorted` (ascending) without one copy of `value` (one of them), as
// the straggler rules compare a rank with the others; null when no other value is left.
function othersMedian(sorted, value) {
  const n = sorted.length - 1;
  if (n < 1) return null;
  let lo = 0, hi = sorted.length;
  while (lo < hi) { const mid = (lo + hi) >> 1; if (sorted[mid] < value) lo = mid + 1; else hi = mid; }
  const at = (j) => sorted[j >= lo ? j + 1 : j];  // the j-th smallest of the others
  return n % 2 ? at((n - 1) / 2) : (at(n / 2 - 1) + at(n / 2)) / 2;
}

// An evidence value (a number, a rank -> value map, a list, ...): its numbers as the page shows every
// number (the wire's "NaN" and "Infinity" strings too: unquoted, as NaN and Infinity), the rest as JSON.
export function evidenceText(x) {
  const n = num(x);
  if (typeof n === "number") return fmt(n);
  if (Array.isArray(x)) return `[${x.map(evidenceText).join(", ")}]`;
  if (x !== null && typeof x === "object") return `{${Object.entries(x).map(([k, v]) => `${JSON.stringify(k)}: ${evidenceText(v)}`).join(", ")}}`;
  return JSON.stringify(x);
}

// The line that says a run was deleted: by whom, when and why (its "deleted" audit event, when known).
function deletionLine(run, info) {
  return [info ? `Run ${run} was deleted by ${info.actor} (${when(info.time)}): ${info.reason}. ` : `Run ${run} was deleted. `,
    "It no longer reports nor takes commands; its audit events stay in the ", h("a", { href: "/ui/audit", "data-link": "" }, "audit log"),
    ". ", h("a", { href: "/ui", "data-link": "" }, "Back to the runs")];
}

export class RunPage {
  constructor(root, run, { onAuth }) {
    this.root = root;
    this.run = run;
    this.onAuth = onAuth;
    this.rows = [];
    this.ranks = [];
    this.events = [];
    this.alerts = [];
    this.incidents = [];
    this.detail = null;
    this.closed = false;
    this.load();
  }

  async load() {
    let data;
    try {
      data = await get(`/ui/api/runs/${encodeURIComponent(this.run)}`);
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) return this.onAuth();
      if (err instanceof ApiError && err.status === 404) return this.showMissing(err.message);
      this.root.replaceChildren(h("p", { class: "error" }, err.message));
      return;
    }
    if (this.closed) return;
    this.build();
    this.capacity = data.run.window_capacity;
    this.rankCapacity = data.run.rank_window_capacity;
    this.addWindow(data.window);
    this.events = data.events;
    this.alerts = data.alerts;
    this.incidents = data.incidents;
    this.setDetail(data.run);
    this.renderAlerts();
    this.renderIncidents();
    this.renderEvents();
    this.redraw();
    const lastEvent = () => (this.events.length ? this.events[this.events.length - 1].id : 0);
    const lastSeq = () => (this.rows.length ? this.rows[this.rows.length - 1].seq : 0);
    this.stream = new Stream(() => `/ui/api/runs/${encodeURIComponent(this.run)}/stream?seq=${lastSeq()}&after=${lastEvent()}`, {
      report: (w) => { this.addWindow(w); this.redraw(); },
      run: (d) => this.setDetail(d),
      audit: (ev) => this.onEvent(ev),
      gone: () => this.checkGone(),
    }, () => this.checkGone());
  }

  // The stream ended or failed: when the run was deleted, say so (with its deletion's audit event
  // once that is readable) instead of reconnecting for ever to a run that is no longer there.
  async checkGone() {
    if (this.deleted || this.checking) return;
    this.checking = true;
    const path = `/ui/api/runs/${encodeURIComponent(this.run)}`;
    try {
      const last = this.events.length ? this.events[this.events.length - 1].id : 0;
      const { events } = await get(`/ui/api/events?run=${encodeURIComponent(this.run)}&limit=20`);
      const ev = events.find((e) => e.kind === "deleted" && e.id > last);
      if (ev) this.markDeleted(ev);
      else await get(`${path}/alerts`); // still registered: the stream reconnects
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) this.onAuth();
      else if (err instanceof ApiError && err.status === 404) this.markDeleted(null);
    } finally {
      this.checking = false;
    }
  }

  // The run was deleted (by this page or by anyone): no more updates nor actions; what the page
  // shows stays, as it was, under a line that says who deleted it, when and why.
  markDeleted(info) {
    if (this.deleted || this.closed) return;
    this.deleted = true;
    if (this.stream) this.stream.close();
    this.actionPanel.detail = null;
    this.actionPanel.render();
    this.removalEl.hidden = true;
    const badge = this.header.querySelector("[data-status]");
    if (badge) badge.replaceWith(statusBadge("deleted"));
    this.deletedEl.replaceChildren(...deletionLine(this.run, info));
    this.deletedEl.hidden = false;
  }

  // A run that is not registered: its deletion when that is the newest of its audit events (a
  // link from the audit log, a reload), else the controller's message.
  async showMissing(message) {
    let ev;
    try {
      ev = (await get(`/ui/api/events?run=${encodeURIComponent(this.run)}&limit=1`)).events.find((e) => e.kind === "deleted");
    } catch {
      ev = undefined;
    }
    if (this.closed) return;
    this.root.replaceChildren(ev ? h("p", { class: "deleted", id: "run-deleted", role: "status" }, ...deletionLine(this.run, ev))
      : h("p", { class: "error" }, message));
  }

  build() {
    this.header = h("div", { class: "run-head" });
    this.actions = h("div", { class: "actions", id: "actions" });
    this.result = h("p", { class: "action-result", id: "action-result", role: "status" });
    this.actionPanel = new Actions(this.actions, this.result, this.run, { onAuth: this.onAuth });
    const removal = new Removal(this.run, { onAuth: this.onAuth, onDeleted: (info) => this.markDeleted(info),
      onResult: (state, text) => this.actionPanel.setResult(state, text) });
    this.removalEl = h("div", { class: "actions removal", id: "removal", hidden: removal.button ? null : true }, removal.button);
    this.deletedEl = h("p", { class: "deleted", id: "run-deleted", role: "status", hidden: true });
    this.desiredEl = h("dl", { class: "facts" });
    this.alertsEl = h("section", { class: "alerts", id: "alerts" });
    this.incidentsEl = h("section", { class: "incidents", id: "incidents" });
    this.preflightEl = h("section", { class: "preflight", id: "preflight" });
    this.chartsEl = h("div", { class: "charts", id: "charts" });
    this.rankChartsEl = h("div", { class: "charts", id: "rank-charts" });
    this.rankTable = h("table", { class: "ranks", id: "rank-table" });
    this.eventsBody = h("tbody");
    this.root.replaceChildren(
      this.deletedEl, this.header, h("details", { class: "desired", id: "desired-state" }, h("summary", {}, "Desired state (every field)"), this.desiredEl),
      this.actions, this.removalEl, this.result, this.alertsEl, this.incidentsEl, this.preflightEl,
      h("h2", {}, "Training signals"),
      h("p", { class: "legend" }, h("span", { class: "mk mk-alert" }), " alert  ", h("span", { class: "mk mk-desired" }),
        " desired state changed  ", h("span", { class: "mk mk-applied" }), " applied by every rank  ",
        h("span", { class: "mk-nan" }, "×"), " NaN or infinite value"),
      this.chartsEl,
      h("h2", {}, "Per rank"),
      h("p", { class: "muted" }, "The newest reports' per-rank values, as the leader gathered them. A rank far slower than the others is a straggler; ranks whose fingerprints differ are out of sync."),
      this.rankTable, this.rankChartsEl,
      h("h2", {}, "Audit log of this run"),
      h("table", { class: "events", id: "run-events" },
        h("thead", {}, h("tr", {}, ["#", "time", "kind", "generation", "actor", "what"].map((t) => h("th", {}, t)))), this.eventsBody));
    this.charts = CHARTS.map((spec) => new Chart(this.chartsEl, spec));
    this.rankCharts = RANK_CHARTS.map((spec) => new Chart(this.rankChartsEl, { ...spec, series: [] }));
  }

  addWindow(w) {
    const lastSeq = this.rows.length ? this.rows[this.rows.length - 1].seq : 0;
    for (const r of w.rows) if (r.seq > lastSeq) this.rows.push(r);
    if (this.rows.length > this.capacity) this.rows.splice(0, this.rows.length - this.capacity);
    const lastRank = this.ranks.length ? this.ranks[this.ranks.length - 1].seq : 0;
    for (const r of w.ranks) if (r.seq > lastRank) this.ranks.push(r);
    if (this.ranks.length > this.rankCapacity) this.ranks.splice(0, this.ranks.length - this.rankCapacity);
  }

  // The step of an audit event on the chart's axis: its own step when it has one, else the step of
  // the last report received before it.
  stepOf(ev) {
    if (ev.data && typeof ev.data.step === "number") return ev.data.step;
    let step = null;
    for (const r of this.rows) { if (r.received <= ev.time) step = r.step; else break; }
    return step;
  }

  markers() {
    const out = [];
    for (const ev of this.events) {
      if (!["alert", "desired", "applied"].includes(ev.kind)) continue;
      const step = this.stepOf(ev);
      if (step !== null) out.push({ step, kind: ev.kind, label: ev.reason });
    }
    return out;
  }

  redraw() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = null;
      if (this.closed) return;
      const steps = this.rows.map((r) => r.step);
      const markers = this.markers();
      this.charts.forEach((chart, i) => {
        const cols = CHARTS[i].series.map((s) => this.rows.map((r) => (s.key in r.values ? num(r.values[s.key]) : null)));
        chart.setData(steps, cols, markers);
      });
      const stepBySeq = new Map(this.rows.map((r) => [r.seq, r.step]));
      const rankRows = this.ranks.filter((r) => stepBySeq.has(r.seq));
      const world = this.detail ? this.detail.world_size : 0;
      this.rankCharts.forEach((chart, i) => {
        const vec = RANK_CHARTS[i].vector;
        if (!chart.plot && world) chart.spec.series = Array.from({ length: world }, (_, r) => ({ label: `rank ${r}` }));
        if (!chart.spec.series.length) return;
        const cols = chart.spec.series.map((_, r) => rankRows.map((row) => (row.vectors[vec] && r < row.vectors[vec].length ? num(row.vectors[vec][r]) : null)));
        chart.setData(rankRows.map((row) => stepBySeq.get(row.seq)), cols, markers);
      });
      this.renderRankTable();
    });
  }

  renderRankTable() {
    const newest = this.ranks[this.ranks.length - 1];
    if (!newest) { this.rankTable.replaceChildren(h("caption", {}, "No per-rank values yet.")); return; }
    const v = newest.vectors;
    const world = Math.max(0, ...RANK_COLUMNS.map((c) => (v[c] ? v[c].length : 0)));
    const times = (v.step_time_s || []).map(num).filter(Number.isFinite).sort((a, b) => a - b);
    // The node each rank registered (absent: an agent older than the field, or no /metrics endpoint).
    const nodes = new Map(((this.detail && this.detail.ranks) || []).filter((e) => e.node).map((e) => [e.rank, e.node]));
    const rows = [];
    for (let r = 0; r < world; r++) {
      const t = v.step_time_s ? num(v.step_time_s[r]) : null;
      const others = Number.isFinite(t) ? othersMedian(times, t) : null;
      rows.push(h("tr", { dataset: { rank: r } }, h("td", {}, `rank ${r}`), h("td", { class: "node" }, nodes.get(r) || "–"),
        ...RANK_COLUMNS.map((c) => h("td", { class: "num" }, v[c] ? fmt(num(v[c][r])) : "–")),
        h("td", { class: "num" }, others > 0 ? `${fmt(t / others)}×` : "–")));
    }
    const step = this.rows.find((r) => r.seq === newest.seq);
    this.rankTable.replaceChildren(
      h("caption", {}, step ? `At step ${step.step}` : "Newest report"),
      h("thead", {}, h("tr", {}, h("th", {}, "rank"), h("th", {}, "node"), ...RANK_COLUMNS.map((c) => h("th", {}, c.replaceAll("_", " "))),
        h("th", {}, "step time / median of the other ranks"))),
      h("tbody", {}, rows));
  }

  setDetail(d) {
    this.detail = d;
    const des = d.desired;
    this.header.replaceChildren(
      h("h1", {}, this.run, " ", statusBadge(d.status)),
      h("dl", { class: "facts" }, ...[
        ["job", d.job], ["step", d.last_step ?? "–", "run-step"], ["ranks", d.world_size], ["reports", d.reports],
        ["paused", des.paused ? "yes" : "no", "run-paused"], ["LR multiplier", fmt(des.lr_scale), "run-lr-scale"],
        ["checkpoints asked", des.checkpoint_seq], ["stop", des.stop ? "yes" : "no"],
        ["desired / applied generation", `${d.desired_generation} / ${d.applied_generation}` +
          (d.applied_step !== null && d.applied_step !== undefined ? ` (at step ${d.applied_step})` : ""), "run-generations"],
      ].map(([k, v, id]) => h("div", {}, h("dt", {}, k), h("dd", { id }, v)))));
    // every field of the desired state, as the commands of the registry set them
    this.desiredEl.replaceChildren(...Object.entries(des).filter(([k]) => k !== "reason" && k !== "generation").map(([k, v]) =>
      h("div", {}, h("dt", {}, k), h("dd", { id: `desired-${k}` }, typeof v === "number" ? fmt(v) : String(v)))));
    this.actionPanel.update(d);
    const received = String(d.preflight ? d.preflight.received : null);
    if (this.preflightEl.dataset.received !== received) {  // drawn again only when a new result arrives
      this.preflightEl.dataset.received = received;
      this.preflightEl.replaceChildren(...preflightSection(d.preflight));
    }
  }

  onEvent(ev) {
    const last = this.events.length ? this.events[this.events.length - 1].id : 0;
    if (ev.id <= last) return;
    this.events.push(ev);
    if (this.events.length > 500) this.events.shift();
    this.eventsBody.prepend(this.eventRow(ev));
    if (ev.kind === "deleted") this.markDeleted(ev);
    if (ev.kind === "alert" || ev.kind === "resolved") this.refreshAlerts();
    if (ev.kind === "incident") this.refreshIncidents();
    this.redraw();
  }

  async refreshAlerts() {
    try {
      this.alerts = await get(`/ui/api/runs/${encodeURIComponent(this.run)}/alerts`);
      this.renderAlerts();
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) this.onAuth();
    }
  }

  async refreshIncidents() {
    try {
      this.incidents = (await get(`/ui/api/runs/${encodeURIComponent(this.run)}/incidents`)).incidents;
      this.renderIncidents();
    } catch (err) {
      if (err instanceof ApiError && err.status === 401) this.onAuth();
    }
  }

  // An incident of the automatic recovery: its onset, its cause with the evidence it was decided on,
  // each rung of the escalation ladder taken (step, by whom, why) and its outcome.
  incidentCard(i) {
    const label = { open: "open: recovering", recovered: "recovered", escalated: "escalated to a human" }[i.outcome] || i.outcome;
    return h("article", { class: `incident outcome-${i.outcome}`, dataset: { incidentId: i.id, outcome: i.outcome, cause: i.cause } },
      h("header", {}, h("span", { class: `badge outcome-${i.outcome}` }, label), " ", h("strong", {}, `incident ${i.id}`),
        ` · onset at step ${i.onset_step} (${i.trigger}), ${when(i.onset_time)}`,
        i.closed_step !== null && i.closed_step !== undefined ? ` · closed at step ${i.closed_step}` : null),
      this.verdictBlock(i),
      h("ol", { class: "rungs" }, i.rungs.map((r) => h("li", { dataset: { rung: r.rung, step: r.step } },
        h("strong", {}, r.rung), ` at step ${r.step} by ${r.actor}: ${r.reason}`))));
  }

  // The cause of an incident and the evidence (what was read, its value, what it points at).
  verdictBlock(i) {
    const v = i.verdict || {};
    const suspects = (v.ranks || []).map((r, k) => `rank ${r} on ${(v.hosts || [])[k]}`).join(", ");
    const exp = i.experiment;
    return h("div", { class: "verdict", dataset: { cause: i.cause || "unknown" } },
      h("p", {}, h("strong", {}, `cause: ${i.cause || "unknown"}`), ` · ${v.summary || ""}`, suspects ? ` · ${suspects}` : null),
      h("ul", { class: "evidence" }, (v.evidence || []).map((e) => h("li", { dataset: { pointsTo: e.points_to, signal: e.signal } },
        h("strong", {}, e.points_to), ` ${e.signal} = ${evidenceText(e.value)}: ${e.detail}`))),
      exp ? h("p", { class: "experiment" }, `experiment: LR x${exp.lr_factor} for steps ${exp.from_step}-${exp.until_step}: ${exp.conclusion || "running"}`) : null,
      i.data_skipped ? h("p", { class: "data-skipped" }, `optimizer steps ${i.data_skipped[0]}-${i.data_skipped[1]} skipped on every rank for their data`) : null);
  }

  renderIncidents() {
    const open = this.incidents.filter((i) => i.outcome === "open").length;
    this.incidentsEl.replaceChildren(
      h("h2", {}, `Incidents (${this.incidents.length}${open ? `, ${open} open` : ""})`),
      this.incidents.length ? h("div", { id: "incident-list" }, this.incidents.map((i) => this.incidentCard(i)))
        : h("p", { class: "muted", id: "incident-list" }, "None: the automatic recovery has not acted on this run."));
  }

  alertCard(a) {
    const d = a.diagnosis || {};
    const values = Object.entries(a.values || {}).map(([k, v]) => h("li", {}, `${k} = ${typeof v === "number" ? fmt(v) : String(v)}`));
    return h("article", { class: `alert sev-${a.severity} state-${a.state}`, dataset: { rule: a.rule, state: a.state, alertId: a.id } },
      h("header", {}, h("span", { class: `badge sev-${a.severity}` }, a.severity), " ", h("strong", {}, a.rule), " · ",
        a.state === "firing" ? `firing since ${when(a.starts_at)}` : `resolved ${when(a.ends_at)}`),
      h("p", { class: "summary" }, a.summary),
      d.symptom ? h("p", { class: "diagnosis" }, h("strong", {}, "What it looks like: "), d.symptom) : null,
      d.likely_causes && d.likely_causes.length ? h("div", { class: "diagnosis" }, h("strong", {}, "Likely causes"), h("ul", {}, d.likely_causes.map((c) => h("li", {}, c)))) : null,
      d.suggested_actions && d.suggested_actions.length ? h("div", { class: "diagnosis" }, h("strong", {}, "What to do"), h("ol", {}, d.suggested_actions.map((c) => h("li", {}, c)))) : null,
      values.length ? h("details", {}, h("summary", {}, "Values that triggered it"), h("ul", {}, values)) : null);
  }

  renderAlerts() {
    const firing = this.alerts.filter((a) => a.state === "firing");
    const resolved = this.alerts.filter((a) => a.state !== "firing");
    this.alertsEl.replaceChildren(
      h("h2", {}, `Firing alerts (${firing.length})`),
      firing.length ? h("div", { id: "firing" }, firing.map((a) => this.alertCard(a))) : h("p", { class: "muted", id: "firing" }, "None: every rule is quiet."),
      ...(resolved.length ? [h("details", { class: "resolved" }, h("summary", {}, `Resolved alerts (${resolved.length})`), resolved.map((a) => this.alertCard(a)))] : []));
  }

  eventRow(ev) {
    return h("tr", { dataset: { kind: ev.kind, id: ev.id } }, h("td", { class: "num" }, ev.id), h("td", {}, when(ev.time)),
      h("td", {}, h("span", { class: `badge kind-${ev.kind}` }, ev.kind)), h("td", { class: "num" }, ev.generation ?? "–"),
      h("td", {}, ev.actor), h("td", {}, ev.reason));
  }

  renderEvents() {
    this.eventsBody.replaceChildren(...this.events.slice().reverse().map((ev) => this.eventRow(ev)));
  }

  close() {
    this.closed = true;
    if (this.stream) this.stream.close();
  }
}
