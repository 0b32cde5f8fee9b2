// The gradwatch tab: TensorBoard loads this ES module into an iframe and calls render().
// Data comes from the plugin's routes (plugin.py): ./runs and ./table?run=&stat=&max_steps=&first=&last=
// One panel per chosen run (two side by side to compare): the gradient-flow heatmap (layers x steps,
// log10 RMS; grey: zero gradient, white: not recorded, magenta: NaN/Inf; red marks: alerts), the
// chosen statistic as one line per layer (coloured by layer, with a legend), and the alert list.
// Clicking an alert zooms every panel to its step and picks out its layer; dragging on a heatmap
// zooms to the steps dragged over.

const MAX_LABEL_W = 230, HEAT_H = 360, LINES_H = 260, AXIS_H = 22;
let LABEL_W = MAX_LABEL_W; // set per panel from its layer names
const NONE = "(none)";
const state = { runs: [], stat: "grad_norm", zoom: null, focus: null, panels: [] };

export async function render() {
  document.body.innerHTML = "";
  document.body.appendChild(styleSheet());
  const root = el("div", { id: "gradwatch" });
  document.body.appendChild(root);
  const runs = await getJSON("./runs");
  if (!runs.length) {
    root.appendChild(el("p", { className: "empty" }, "No gradwatch data in this log directory yet: attach a GradMonitor (or the Lightning / Hugging Face callback) with a logdir, then reload."));
    return;
  }
  state.allRuns = runs;
  state.runs = [runs[0].run];
  root.appendChild(controls(runs));
  const panels = el("div", { id: "panels" });
  root.appendChild(panels);
  await redraw();
}

function controls(runs) {
  const bar = el("div", { id: "controls" });
  const names = runs.map((r) => r.run);
  const runA = select("run-a", names, names[0], (v) => { state.runs[0] = v; redraw(); });
  const runB = select("run-b", [NONE, ...names], NONE, (v) => {
    state.runs = v === NONE ? [state.runs[0]] : [state.runs[0], v]; redraw();
  });
  const stats = [...new Set(runs.flatMap((r) => r.stats))].filter((s) => s !== "log10_grad_rms");
  const stat = select("stat", stats, stats.includes("grad_norm") ? "grad_norm" : stats[0], (v) => { state.stat = v; redraw(); });
  state.stat = stat.value;
  const reset = el("button", { id: "reset-zoom", onclick: () => { state.zoom = null; state.focus = null; redraw(); } }, "whole run");
  const zoom = el("span", { id: "zoom-label" }, "");
  bar.append(label("run", runA), label("compare with", runB), label("lines", stat), reset, zoom);
  return bar;
}

async function redraw() {
  const holder = document.getElementById("panels");
  const label = document.getElementById("zoom-label");
  label.textContent = state.zoom ? `steps ${state.zoom[0]}-${state.zoom[1]}` : "";
  holder.innerHTML = "";
  holder.className = state.runs.length > 1 ? "two" : "one";
  const room = document.documentElement.clientWidth - 24 - 16 * (state.runs.length - 1);
  const width = Math.max(420, Math.floor(room / state.runs.length));
  const loaded = await Promise.all(state.runs.map((run) => load(run, width)));
  // one colour scale for every panel, so that runs compared side by side read alike
  const finite = loaded.flatMap((p) => p.heat.values.flat().filter((v) => typeof v === "number" && v > -29.9));
  const range = [quantile(finite, 0.02), quantile(finite, 0.98)];
  state.panels = loaded.map((p) => panel(p, range));
  for (const p of state.panels) holder.appendChild(p);
}

async function load(run, width) {
  const zoom = state.zoom ? `&first=${state.zoom[0]}&last=${state.zoom[1]}` : "";
  const q = (stat) => `./table?run=${encodeURIComponent(run)}&stat=${stat}&max_steps=${width}${zoom}`;
  const [heat, lines] = await Promise.all([getJSON(q("log10_grad_rms")), getJSON(q(state.stat))]);
  return { run, width, heat, lines };
}

function panel({ run, width, heat, lines }, range) {
  const box = el("div", { className: "panel" });
  box.dataset.run = run;
  LABEL_W = labelWidth(heat);
  const plotW = width - LABEL_W - 8;
  const info = state.allRuns.find((r) => r.run === run);
  box.appendChild(el("h3", {}, `${run}  ·  ${info.layers} layers  ·  ${info.alerts} alert(s)`));
  box.appendChild(heatmap(heat, plotW, range));
  box.appendChild(linePlot(lines, plotW));
  box.appendChild(alertList(heat.alerts));
  return box;
}

// ------------------------------------------------------------------ heatmap
function heatmap(t, plotW, [lo, hi]) {
  const n = t.layers.length, m = t.steps.length, labelW = LABEL_W; // the handlers below keep this panel's
  const rowH = Math.max(3, Math.min(24, Math.floor(HEAT_H / Math.max(1, n))));
  const canvas = el("canvas", { className: "heatmap" });
  const cssW = LABEL_W + plotW, cssH = rowH * n + AXIS_H + 10;
  const ctx = hiDPI(canvas, cssW, cssH);
  const colW = plotW / Math.max(1, m);
  ctx.font = "11px sans-serif";
  ctx.textBaseline = "middle";
  const labelEvery = Math.ceil(11 / rowH);
  for (let i = 0; i < n; i++) {
    const y = 10 + i * rowH;
    if (i % labelEvery === 0) {
      ctx.fillStyle = t.layers[i] === state.focus ? "#d62728" : "#222";
      ctx.fillText(fit(ctx, layerName(t, i), LABEL_W - 8), 2, y + rowH / 2);
    }
    for (let j = 0; j < m; j++) { // whole pixels: no seams between columns
      const x0 = Math.floor(LABEL_W + j * colW), x1 = Math.floor(LABEL_W + (j + 1) * colW);
      ctx.fillStyle = cellColour(t.values[i][j], lo, hi);
      ctx.fillRect(x0, y, Math.max(1, x1 - x0), rowH);
    }
  }
  const stepX = (step) => LABEL_W + columnOf(t.steps, step) * colW + colW / 2;
  ctx.fillStyle = "#d62728"; ctx.strokeStyle = "#d62728"; ctx.lineWidth = 2;
  for (const a of t.alerts) {
    if (!inRange(t.steps, a.step)) continue;
    const x = stepX(a.step);
    ctx.beginPath(); ctx.moveTo(x - 5, 0); ctx.lineTo(x + 5, 0); ctx.lineTo(x, 9); ctx.fill();
    const row = t.layers.indexOf(a.layer);
    if (row >= 0) ctx.strokeRect(x - Math.max(colW, 4) / 2, 10 + row * rowH, Math.max(colW, 4), rowH);
  }
  if (state.focus && t.layers.includes(state.focus)) {
    const row = t.layers.indexOf(state.focus);
    ctx.strokeStyle = "#000"; ctx.lineWidth = 1;
    ctx.strokeRect(LABEL_W - 1, 10 + row * rowH - 1, plotW + 2, rowH + 2);
  }
  stepAxis(ctx, t.steps, LABEL_W, plotW, 10 + n * rowH + 2);
  const box = el("div", { className: "heatwrap" });
  box.appendChild(el("div", { className: "caption" }, `gradient RMS per layer, log10 (colour ${fmt(lo)} .. ${fmt(hi)}, the same in every panel; grey: zero gradient; white: not recorded; magenta: NaN/Inf; red: alerts; drag to zoom)`));
  box.appendChild(canvas);
  const tip = el("div", { className: "tip" });
  box.appendChild(tip);
  const cell = (ev) => {
    const r = canvas.getBoundingClientRect();
    const x = ev.clientX - r.left - labelW, y = ev.clientY - r.top - 10;
    return [Math.floor(y / rowH), Math.min(m - 1, Math.max(0, Math.floor(x / colW)))];
  };
  canvas.addEventListener("mousemove", (ev) => {
    const [i, j] = cell(ev);
    if (i < 0 || i >= n) { tip.style.display = "none"; return; }
    const v = t.values[i][j];
    tip.textContent = `${layerName(t, i)} · step ${t.steps[j]} · ${v === null ? "not recorded" : v <= -29.9 ? "zero gradient" : "log10 RMS " + fmt(v)}`;
    tip.style.display = "block"; tip.style.left = `${ev.offsetX + 12}px`; tip.style.top = `${ev.offsetY + 12}px`;
  });
  canvas.addEventListener("mouseleave", () => { tip.style.display = "none"; });
  let dragFrom = null;
  canvas.addEventListener("mousedown", (ev) => { dragFrom = cell(ev)[1]; });
  canvas.addEventListener("mouseup", (ev) => {
    if (dragFrom === null) return;
    const to = cell(ev)[1], a = Math.min(dragFrom, to), b = Math.max(dragFrom, to);
    dragFrom = null;
    if (b > a) { state.zoom = [t.steps[a], t.steps[b]]; redraw(); }
    else { const [i] = cell(ev); if (i >= 0 && i < n) { state.focus = t.layers[i]; redraw(); } }
  });
  return box;
}

function cellColour(v, lo, hi) {
  if (v === null) return "#ffffff";
  if (typeof v === "string") return "#e000e0"; // NaN, Infinity
  if (v <= -29.9) return "#9e9e9e";
  const f = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0.5;
  return viridis(f);
}

// -------------------------------------------------------------------- lines
function linePlot(t, plotW) {
  const box = el("div", { className: "lineswrap" });
  const log = !!(t.meta && t.meta.log);
  box.appendChild(el("div", { className: "caption" }, `${(t.meta && t.meta.label) || t.stat}, one line per layer${log ? " (log scale; zero drawn on the bottom edge)" : ""}; no smoothing, no outliers dropped; click a layer in the legend to pick it out`));
  const canvas = el("canvas", { className: "lines" });
  const cssW = LABEL_W + plotW, cssH = LINES_H + AXIS_H;
  const ctx = hiDPI(canvas, cssW, cssH);
  const num = (v) => (typeof v === "number" ? v : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : NaN);
  const ys = t.values.flat().map(num).filter((v) => Number.isFinite(v) && (!log || v > 0));
  const tr = (v) => (log ? Math.log10(v) : v);
  let lo = ys.length ? Math.min(...ys.map(tr)) : 0, hi = ys.length ? Math.max(...ys.map(tr)) : 1;
  if (hi === lo) { lo -= 1; hi += 1; }
  const m = t.steps.length, colW = plotW / Math.max(1, m);
  const X = (j) => LABEL_W + j * colW + colW / 2;
  const Y = (v) => (log && v <= 0 ? LINES_H - 2 : 6 + (LINES_H - 12) * (1 - (tr(v) - lo) / (hi - lo)));
  const drawable = (v) => Number.isFinite(v) && (!log || v >= 0);
  ctx.font = "11px sans-serif"; ctx.fillStyle = "#444"; ctx.textBaseline = "middle";
  for (let k = 0; k <= 4; k++) {
    const v = lo + ((hi - lo) * k) / 4, y = Y(log ? 10 ** v : v);
    ctx.fillText(fmt(log ? 10 ** v : v), LABEL_W - 64, y);
    ctx.strokeStyle = "#eee"; ctx.beginPath(); ctx.moveTo(LABEL_W, y); ctx.lineTo(LABEL_W + plotW, y); ctx.stroke();
  }
  t.layers.forEach((layer, i) => {
    const focused = state.focus === layer, faded = state.focus && !focused;
    ctx.strokeStyle = colour(i, t.layers.length, faded ? 0.15 : 1);
    ctx.lineWidth = focused ? 2.5 : 1.2;
    ctx.beginPath();
    let pen = false;
    t.values[i].forEach((raw, j) => {
      const v = num(raw);
      if (!drawable(v)) { pen = false; return; }
      if (pen) ctx.lineTo(X(j), Y(v)); else ctx.moveTo(X(j), Y(v));
      pen = true;
    });
    ctx.stroke();
    t.values[i].forEach((raw, j) => { // isolated points (window statistics) as dots
      const v = num(raw);
      if (drawable(v) && !drawable(num(t.values[i][j - 1])) && !drawable(num(t.values[i][j + 1]))) {
        ctx.fillStyle = colour(i, t.layers.length, faded ? 0.15 : 1); ctx.fillRect(X(j) - 2, Y(v) - 2, 4, 4);
      }
    });
  });
  for (const a of t.alerts || []) {
    if (!inRange(t.steps, a.step)) continue;
    const x = X(columnOf(t.steps, a.step));
    ctx.strokeStyle = "rgba(214,39,40,0.6)"; ctx.lineWidth = 1; ctx.setLineDash([3, 3]);
    ctx.beginPath(); ctx.moveTo(x, 0); ctx.lineTo(x, LINES_H); ctx.stroke(); ctx.setLineDash([]);
  }
  stepAxis(ctx, t.steps, LABEL_W, plotW, LINES_H + 2);
  box.appendChild(canvas);
  const legend = el("div", { className: "legend" });
  t.layers.forEach((layer, i) => {
    const chip = el("span", { className: "chip" + (state.focus === layer ? " focus" : ""), title: layerName(t, i),
      onclick: () => { state.focus = state.focus === layer ? null : layer; redraw(); } });
    chip.append(el("i", { style: `background:${colour(i, t.layers.length, 1)}` }), layerName(t, i));
    legend.appendChild(chip);
  });
  box.appendChild(legend);
  return box;
}

// ------------------------------------------------------------------- alerts
function alertList(alerts) {
  const box = el("div", { className: "alerts" });
  if (!alerts.length) { box.appendChild(el("p", {}, "No alerts.")); return box; }
  const table = el("table");
  table.appendChild(row("th", ["kind", "layer", "step", "value", "threshold", "what it says"]));
  for (const a of alerts) {
    const tr = row("td", [a.kind, a.layer || "(whole model)", a.step, fmt(a.value), fmt(a.threshold), a.message || ""]);
    tr.className = "alert"; tr.title = "show this step and layer";
    tr.onclick = () => {
      const span = 25;
      state.zoom = [Math.max(0, a.step - span), a.step + span];
      state.focus = a.layer || null;
      redraw();
    };
    table.appendChild(tr);
  }
  box.appendChild(table);
  return box;
}

// ------------------------------------------------------------------ helpers
function stepAxis(ctx, steps, x0, w, y) {
  ctx.fillStyle = "#444"; ctx.font = "11px sans-serif"; ctx.textBaseline = "top";
  const m = steps.length, ticks = Math.min(8, m);
  for (let k = 0; k < ticks; k++) {
    const j = Math.round((k * (m - 1)) / Math.max(1, ticks - 1));
    const x = x0 + (j + 0.5) * (w / Math.max(1, m));
    ctx.fillText(String(steps[j]), Math.min(x, x0 + w - 30), y + 2);
  }
  ctx.fillText("step", x0 - 30, y + 2);
}
function labelWidth(t) {
  const ctx = document.createElement("canvas").getContext("2d");
  ctx.font = "11px sans-serif";
  const widest = Math.max(0, ...t.layers.map((_, i) => ctx.measureText(layerName(t, i)).width));
  return Math.round(Math.min(MAX_LABEL_W, Math.max(70, widest + 14)));
}
function layerName(t, i) { return t.types && t.types[i] ? `${t.layers[i]} (${t.types[i]})` : t.layers[i]; }
function columnOf(steps, step) { let j = 0; while (j + 1 < steps.length && steps[j + 1] <= step) j++; return j; }
function inRange(steps, step) { return steps.length > 0 && step >= steps[0] && step <= steps[steps.length - 1]; }
function quantile(xs, q) { if (!xs.length) return 0; const s = [...xs].sort((a, b) => a - b); return s[Math.min(s.length - 1, Math.floor(q * (s.length - 1)))]; }
function fmt(v) { return typeof v !== "number" ? String(v) : Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : String(+v.toFixed(3)); }
function colour(i, n, alpha) { return `hsla(${Math.round((360 * i * 0.618033) % 360)}, 70%, ${42 + 12 * (i % 3)}%, ${alpha})`; }
function viridis(f) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = f * (stops.length - 1), k = Math.min(stops.length - 2, Math.floor(x)), u = x - k;
  const c = stops[k].map((a, z) => Math.round(a + (stops[k + 1][z] - a) * u));
  return `rgb(${c[0]},${c[1]},${c[2]})`;
}
function fit(ctx, text, w) { if (ctx.measureText(text).width <= w) return text; while (text.length > 4 && ctx.measureText("…" + text).width > w) text = text.slice(1); return "…" + text; }
function hiDPI(canvas, w, h) {
  const r = window.devicePixelRatio || 1;
  canvas.width = Math.round(w * r); canvas.height = Math.round(h * r);
  canvas.style.width = `${w}px`; canvas.style.height = `${h}px`;
  const ctx = canvas.getContext("2d"); ctx.scale(r, r); return ctx;
}
async function getJSON(url) { const r = await fetch(url); if (!r.ok) throw new Error(`${url}: ${r.status}`); return r.json(); }
function el(tag, props = {}, text) { const e = Object.assign(document.createElement(tag), props); if (text !== undefined) e.append(text); return e; }
function row(cell, values) { const tr = el("tr"); for (const v of values) tr.appendChild(el(cell, {}, String(v))); return tr; }
function label(text, control) { const l = el("label", {}, text + " "); l.appendChild(control); return l; }
function select(id, options, value, onchange) {
  const s = el("select", { id });
  for (const o of options) s.appendChild(el("option", { value: o }, o));
  s.value = value; s.onchange = () => onchange(s.value); return s;
}
function styleSheet() {
  return el("style", {}, `
    body { font-family: Roboto, sans-serif; font-size: 13px; margin: 8px; color: #212121; }
    #controls { display: flex; gap: 16px; align-items: center; margin-bottom: 8px; flex-wrap: wrap; }
    #panels.two { display: flex; gap: 16px; } .panel { position: relative; }
    h3 { font-size: 14px; margin: 6px 0; } .caption { color: #555; margin: 4px 0; }
    .heatwrap { position: relative; } .tip { position: absolute; display: none; background: #fff; border: 1px solid #999; padding: 2px 6px; pointer-events: none; white-space: nowrap; }
    .legend { display: flex; flex-wrap: wrap; gap: 4px 10px; max-height: 90px; overflow: auto; margin: 4px 0 8px; }
    .chip { cursor: pointer; white-space: nowrap; } .chip i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
    .chip.focus { font-weight: bold; } table { border-collapse: collapse; } td, th { border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: left; }
    tr.alert { cursor: pointer; } tr.alert:hover { background: #fde0e0; } .empty { color: #555; }`);
}
