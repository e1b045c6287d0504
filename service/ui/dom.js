// A few DOM helpers. Text always goes in as text nodes (never innerHTML): run names, reasons and
// diagnoses come from the network.
export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") el.className = v;
    else if (k === "dataset") Object.assign(el.dataset, v);
    else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

export function when(t) {
  if (t === null || t === undefined) return "–";
  return new Date(t * 1000).toLocaleString();
}

export function ago(t) {
  if (t === null || t === undefined) return "never";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 90) return `${Math.round(s)} s ago`;
  if (s < 5400) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

export function runLink(run) {
  return h("a", { href: `/ui/runs/${encodeURIComponent(run)}`, "data-link": "" }, run);
}

export function statusBadge(status) {
  return h("span", { class: `badge status-${status}`, dataset: { status } }, status);
}
