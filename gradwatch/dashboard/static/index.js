// The gradwatch tab: TensorBoard loads this ES module into an iframe and calls render().
// Data comes from the plugin's routes (plugin.py): ./runs and ./table?run=&stat=&max_steps=&first=&last=
// One panel per chosen run (two side by side to compare): the gradient-flow heatmap (layers x steps,
// log10 RMS; grey: zero gradient, white: not recorded, magenta: NaN/Inf; red marks: alerts), the
// chosen statistic as one line per layer (coloured by layer, with a legend), and the alert list.
// Clicking an alert zooms every panel to its step and picks out its layer; dragging on a heatmap
// zooms to the steps dragged over.

const MAX_LABEL_W = 230, HEAT_H = 360, LINES_H = 260, AXIS_H = 22, MAX_LINES = 40;
let LABEL_W = MAX_LABEL_W; // set per panel from its layer names
const NONE = "(none)";
const state = { runs: [], stat: "grad_norm", zoom: null, focus: null, filter: "", panels: [] };

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
  // Many layers: a filter keeps the matching rows (and lines), each with its name.
  const filter = el("input", { id: "layer-filter", type: "search", placeholder: "e.g. attn|mlp.0", size: 16 });
  let pending = null;
  filter.oninput = () => { clearTimeout(pending); pending = setTimeout(() => { state.filter = filter.value; redraw(); }, 300); };
  bar.append(label("run", runA), label("compare with", runB), label("lines", stat), label("layers", filter), reset, zoom);
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
  try {
    const loaded = await Promise.all(state.runs.map((run) => load(run, width)));
    // one colour scale for every panel, so that runs compared side by side read alike
    const finite = loaded.flatMap((p) => p.heat.values.flat().filter((v) => typeof v === "number" && v > -29.9));
    const range = [quantile(finite, 0.02), quantile(finite, 0.98)];
    state.panels = loaded.map((p) => panel(p, range));
  } catch (error) { // said on the page, not only in the console
    holder.appendChild(el("p", { className: "error" }, `gradwatch could not draw this view: ${error.message}`));
    return;
  }
  for (const p of state.panels) holder.appendChild(p);
}

async function load(run, width) {
  const zoom = state.zoom ? `&first=${state.zoom[0]}&last=${state.zoom[1]}` : "";
  const q = (stat) => `./table?run=${encodeURIComponent(run)}&stat=${stat}&max_steps=${width}${zoom}`;
  const [heat, lines] = await Promise.all([getJSON(q("log10_grad_rms")), getJSON(q(state.stat))]);
  return { run, width, heat: only(decoded(heat), state.filter), lines: only(decoded(lines), state.filter) };
}

function decoded(t) { // values: base64 float32 + a recorded byte per cell (data.RunTable.encoded) -> rows
  const [n, m] = t.values.shape, f = new Float32Array(bytes(t.values.float32).buffer), seen = bytes(t.values.recorded);
  const rows = [];
  for (let i = 0; i < n; i++) {
    const row = new Array(m);
    for (let j = 0, k = i * m; j < m; j++, k++) {
      const v = f[k];
      row[j] = !seen[k] ? null : Number.isNaN(v) ? "NaN" : v === Infinity ? "Infinity" : v === -Infinity ? "-Infinity" : v;
    }
    rows.push(row);
  }
  return { ...t, values: rows };
}
function bytes(b64) { const s = atob(b64), a = new Uint8Array(s.length); for (let i = 0; i < s.length; i++) a[i] = s.charCodeAt(i); return a; }

function only(t, filter) { // the layers whose name (or module type) matches the filter, as a regular expression
  if (!filter) return t;
  let pattern;
  try { pattern = new RegExp(filter); } catch (e) { pattern = { test: (s) => s.includes(filter) }; }
  const keep = t.layers.map((name, i) => pattern.test(name) || pattern.test((t.types && t.types[i]) || ""));
  const pick = (xs) => (xs ? xs.filter((_, i) => keep[i]) : xs);
  return { ...t, layers: pick(t.layers), types: pick(t.types), values: pick(t.values) };
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
  const rowH = Math.min(24, Math.max(1, Math.floor(HEAT_H / Math.max(1, n)))); // 500 layers: 1 px rows, filter to read names
  const canvas = el("canvas", { className: "heatmap" });
  const cssW = LABEL_W + plotW, cssH = rowH * n + AXIS_H + 10;
  const ctx = hiDPI(canvas, cssW, cssH);
  const colW = plotW / Math.max(1, m);
  ctx.font = "11px sans-serif";
  ctx.textBaseline = "middle";
  const labelEvery = Math.ceil(11 / rowH);
  // One pixel per cell in an offscreen image, scaled up without smoothing: 500 layers x 1280
  // steps is one drawImage, not 640,000 fillRects.
  const cells = new ImageData(Math.max(1, m), Math.max(1, n));
  for (let i = 0; i < n; i++) {
    const y = 10 + i * rowH;
    if (i % labelEvery === 0) {
      ctx.fillStyle = t.layers[i] === state.focus ? "#d62728" : "#222";
      ctx.fillText(fit(ctx, layerName(t, i), LABEL_W - 8), 2, y + rowH / 2);
    }
    for (let j = 0; j < m; j++) {
      const c = cellColour(t.values[i][j], lo, hi), k = 4 * (i * m + j);
      cells.data[k] = c[0]; cells.data[k + 1] = c[1]; cells.data[k + 2] = c[2]; cells.data[k + 3] = 255;
    }
  }
  const image = document.createElement("canvas");
  image.width = cells.width; image.height = cells.height;
  image.getContext("2d").putImageData(cells, 0, 0);
  ctx.imageSmoothingEnabled = false;
  if (m && n) ctx.drawImage(image, LABEL_W, 10, plotW, rowH * n);
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

function cellColour(v, lo, hi) { // [r, g, b]
  if (v === null) return [255, 255, 255];
  if (typeof v === "string") return [224, 0, 224]; // NaN, Infinity
  if (v <= -29.9) return [158, 158, 158];
  const f = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0.5;
  return viridis(f);
}

// -------------------------------------------------------------------- lines
function linePlot(all, plotW) {
  const box = el("div", { className: "lineswrap" });
  const log = !!(all.meta && all.meta.log);
  const t = fewLines(all);
  const shown = t.layers.length < all.layers.length ? ` (${t.layers.length} of ${all.layers.length} layers: the alerted, the picked and an even sample; the layers filter chooses others)` : "";
  box.appendChild(el("div", { className: "caption" }, `${(t.meta && t.meta.label) || t.stat}, one line per layer${shown}${log ? "; log scale, zero drawn on the bottom edge" : ""}; no smoothing, no outliers dropped; click a layer in the legend to pick it out`));
  const canvas = el("canvas", { className: "lines" });
  const cssW = LABEL_W + plotW, cssH = LINES_H + AXIS_H;
  const ctx = hiDPI(canvas, cssW, cssH);
  const num = (v) => (typeof v === "number" ? v : v === "Infinity" ? Infinity : v === "-Infinity" ? -Infinity : NaN);
  const ys = t.values.flat().map(num).filter((v) => Number.isFinite(v) && (!log || v > 0));
  const tr = (v) => (log ? Math.log10(v) : v);
  let lo = Infinity, hi = -Infinity; // a loop: spreading 500 layers x 1280 steps into Math.min overflows the stack
  for (const v of ys) { const y = tr(v); if (y < lo) lo = y; if (y > hi) hi = y; }
  if (!ys.length) { lo = 0; hi = 1; }
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
    const row = t.values[i].map(num), ok = row.map(drawable);
    ctx.strokeStyle = ctx.fillStyle = colour(i, t.layers.length, faded ? 0.15 : 1);
    ctx.lineWidth = focused ? 2.5 : 1.2;
    ctx.beginPath();
    for (let j = 0; j < m; j++) {
      if (!ok[j]) continue;
      if (j > 0 && ok[j - 1]) ctx.lineTo(X(j), Y(row[j])); else ctx.moveTo(X(j), Y(row[j]));
    }
    ctx.stroke();
    for (let j = 0; j < m; j++) { // isolated points (window statistics) as dots
      if (ok[j] && !ok[j - 1] && !ok[j + 1]) ctx.fillRect(X(j) - 2, Y(row[j]) - 2, 4, 4);
    }
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

function fewLines(t) { // more lines than anyone can tell apart: the alerted layers, the picked one, an even sample
  if (t.layers.length <= MAX_LINES) return t;
  const alerted = new Set((t.alerts || []).map((a) => a.layer));
  const keep = new Set(t.layers.flatMap((name, i) => (alerted.has(name) || name === state.focus ? [i] : [])));
  const every = t.layers.length / Math.max(1, MAX_LINES - keep.size);
  for (let x = 0; keep.size < MAX_LINES && x < t.layers.length; x += every) keep.add(Math.floor(x));
  const rows = [...keep].sort((a, b) => a - b);
  return { ...t, layers: rows.map((i) => t.layers[i]), types: t.types && rows.map((i) => t.types[i]), values: rows.map((i) => t.values[i]) };
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
function quantile(xs, q) { // a typed array sorts numbers natively: 600,000 values in tens of ms
  if (!xs.length) return 0;
  const s = Float64Array.from(xs).sort();
  return s[Math.min(s.length - 1, Math.floor(q * (s.length - 1)))];
}
function fmt(v) { return typeof v !== "number" ? String(v) : Math.abs(v) >= 1e4 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(2) : String(+v.toFixed(3)); }
function colour(i, n, alpha) { return `hsla(${Math.round((360 * i * 0.618033) % 360)}, 70%, ${42 + 12 * (i % 3)}%, ${alpha})`; }
function viridis(f) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = f * (stops.length - 1), k = Math.min(stops.length - 2, Math.floor(x)), u = x - k;
  return stops[k].map((a, z) => Math.round(a + (stops[k + 1][z] - a) * u));
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
    tr.alert { cursor: pointer; } tr.alert:hover { background: #fde0e0; } .empty { color: #555; } .error { color: #b71c1c; }`);
}
