// Line charts over the step axis (uPlot), with alert and desired-state markers drawn as vertical
// lines and non-finite values (NaN, Inf: real values that uPlot cannot draw) as red crosses at the
// top. Each chart's element carries data-points (finite points drawn, all series together) and
// data-nonfinite (non-finite values marked), which tests and people can read.
import uPlot from "./vendor/uplot/uPlot.esm.js";

export const PALETTE = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
const MARKER = { alert: "#dc2626", desired: "#9333ea", applied: "#059669" };

function fmt(v) {
  if (v === null || v === undefined) return "–";
  if (!Number.isFinite(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(2);
  return String(+v.toPrecision(4));
}
export { fmt };

const isPowerOfTen = (v) => v > 0 && Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-9;

export class Chart {
  // spec: {id, title, unit, log, series: [{label}]}
  constructor(parent, spec) {
    this.spec = spec;
    this.el = document.createElement("figure");
    this.el.className = "chart";
    this.el.dataset.chart = spec.id;
    this.el.dataset.points = "0";
    this.el.dataset.nonfinite = "0";
    const cap = document.createElement("figcaption");
    cap.textContent = spec.title;
    this.latest = document.createElement("span");
    this.latest.className = "latest";
    cap.append(" ", this.latest);
    this.el.append(cap);
    this.plotEl = document.createElement("div");
    this.el.append(this.plotEl);
    parent.append(this.el);
    this.markers = [];
    this.nonfinite = [];
    this.plot = null;
  }

  options(width) {
    const self = this;
    return {
      width, height: 170,
      legend: { show: this.spec.series.length > 1, live: false },
      cursor: { drag: { x: true, y: false } },
      // the x range reaches the newest marker: a pause applied after the last report still shows
      scales: { x: { time: false, range: (u, min, max) => (max === null ? [min, max] : [min, Math.max(max, self.markerMax ?? max)]) }, y: this.spec.log ? { distr: 3 } : {} },
      axes: [{ label: "step", size: 34, labelSize: 14 }, { size: 70, values: (u, vals) => vals.map((v) => (this.spec.log && !isPowerOfTen(v) ? "" : fmt(v))) }],
      series: [{ label: "step" }, ...this.spec.series.map((s, i) => ({
        label: s.label, stroke: s.color || PALETTE[i % PALETTE.length], width: 1.5, spanGaps: false,
        points: { size: 4 },
      }))],
      hooks: { draw: [(u) => self.drawMarkers(u)] },
    };
  }

  // steps: number[]; columns: one array per series (numbers, NaN/Inf allowed, null = absent).
  // markers: [{step, kind, label}].
  setData(steps, columns, markers) {
    let points = 0;
    this.nonfinite = [];
    const drawn = columns.map((col) => col.map((v, i) => {
      if (v === null || v === undefined) return null;
      if (!Number.isFinite(v)) { this.nonfinite.push({ step: steps[i], value: v }); return null; }
      if (this.spec.log && v <= 0) return null;
      points += 1;
      return v;
    }));
    this.markers = markers || [];
    this.markerMax = this.markers.length ? Math.max(...this.markers.map((m) => m.step)) : null;
    this.el.dataset.points = String(points);
    this.el.dataset.nonfinite = String(this.nonfinite.length);
    const last = columns.map((col) => { for (let i = col.length - 1; i >= 0; i--) if (col[i] !== null && col[i] !== undefined) return col[i]; return null; });
    this.latest.textContent = last.every((v) => v === null) ? "not reported" : last.length === 1 ? fmt(last[0]) : "";
    const data = [steps, ...drawn];
    const width = Math.max(this.plotEl.clientWidth || this.el.clientWidth || 400, 240);
    if (!this.plot) {
      this.plot = new uPlot(this.options(width), data, this.plotEl);
      new ResizeObserver(() => {
        const w = this.plotEl.clientWidth;
        if (w && Math.abs(w - this.plot.width) > 4) this.plot.setSize({ width: w, height: 170 });
      }).observe(this.plotEl);
    } else {
      this.plot.setData(data);
    }
  }

  drawMarkers(u) {
    const ctx = u.ctx;
    const { left, top, width, height } = u.bbox;
    ctx.save();
    ctx.lineWidth = 1.5 * devicePixelRatio;
    for (const m of this.markers) {
      const x = u.valToPos(m.step, "x", true);
      if (!(x >= left && x <= left + width)) continue;
      ctx.strokeStyle = MARKER[m.kind] || "#6b7280";
      ctx.setLineDash(m.kind === "alert" ? [] : [4 * devicePixelRatio, 3 * devicePixelRatio]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.setLineDash([]);
    ctx.strokeStyle = "#dc2626";
    const r = 4 * devicePixelRatio;
    for (const n of this.nonfinite) {
      const x = u.valToPos(n.step, "x", true);
      if (!(x >= left && x <= left + width)) continue;
      const y = top + r + 2;
      ctx.beginPath();
      ctx.moveTo(x - r, y - r); ctx.lineTo(x + r, y + r);
      ctx.moveTo(x + r, y - r); ctx.lineTo(x - r, y + r);
      ctx.stroke();
    }
    ctx.restore();
  }
}
