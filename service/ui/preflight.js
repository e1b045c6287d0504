// The run's pre-flight: the checks the agent ran on a real batch before the first step
// (agent.preflight), as the controller keeps them in the run's status: the checklist before a large
// run (gradient values, the initial parameters, the loss on extreme inputs, the data pipeline's
// throughput, overflow under mixed precision) and the optimizer, mixed-precision and setup checks.
import { fmt } from "./charts.js";
import { h, when } from "./dom.js";

// What a run without a pre-flight result was not checked for before it trained.
const NOT_RUN = "None: the run sent no pre-flight result (agent.preflight(batch, ...) before its first step, or " +
  "trainguard preflight SCRIPT), so nothing was checked before it trained: gradient values below 1e3, the " +
  "parameters' initial distribution, the loss on extreme inputs, the data pipeline's throughput, overflow under " +
  "mixed precision.";

// The section's children for `p`, the run status's `preflight` (null: none received).
export function preflightSection(p) {
  if (!p) return [h("h2", {}, "Pre-flight checks"), h("p", { class: "muted", id: "preflight-none" }, NOT_RUN)];
  const counts = p.counts || {};
  return [
    h("h2", {}, `Pre-flight checks (${counts.fail || 0} failed, ${counts.warn || 0} warned)`),
    h("p", { class: "muted" }, `Run on a real batch before the first step by rank ${p.rank}, in ${fmt(p.seconds)} s; received ${when(p.received)}.`),
    h("table", { class: "preflight-checks", id: "preflight-checks" },
      h("thead", {}, h("tr", {}, ["check", "result", "detail"].map((t) => h("th", {}, t)))),
      h("tbody", {}, (p.checks || []).map((c) => h("tr", { dataset: { check: c.name, status: c.status } },
        h("td", {}, c.name), h("td", {}, h("span", { class: `badge check-${c.status}` }, c.status)), h("td", {}, c.detail))))),
  ];
}
