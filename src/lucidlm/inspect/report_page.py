"""The HTML page of ``lucidlm inspect``'s report: markup, CSS and the inline JavaScript that draws it.

A template, not Python logic: ``report.build_report`` puts the escaped title where
``__TITLE__`` stands and the report's JSON where ``__DATA__`` stands. The script reads that
JSON from ``#report-data`` and draws the tokens, the top-k table, the attention heatmap (SVG,
re-drawn when the layer/head controls change) and the logit lens; the element ids it uses are
the ones ``report.py``'s docstring lists for tests and styling.
"""

PAGE = r"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
  body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 16px 24px; color: #1b1f24;
         background: #fff; }
  h1 { font-size: 20px; margin: 0 0 4px; }
  h2 { font-size: 16px; margin: 18px 0 6px; border-bottom: 1px solid #d0d7de; padding-bottom: 3px; }
  .meta { color: #57606a; font-size: 13px; }
  #tokens { display: flex; flex-wrap: wrap; gap: 3px; }
  .token { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre; padding: 2px 4px;
           border-radius: 3px; background: #ddf4ff; border: 1px solid #54aeff; cursor: pointer; font-size: 13px; }
  .token.selected { background: #ffd33d; border-color: #bf8700; }
  .controls { display: flex; gap: 16px; align-items: center; font-size: 13px; margin-bottom: 6px; }
  .columns { display: flex; gap: 24px; align-items: flex-start; flex-wrap: wrap; }
  table { border-collapse: collapse; font-size: 12px; }
  td, th { padding: 2px 5px; border: 1px solid #eaeef2; text-align: left; }
  th { background: #f6f8fa; font-weight: 600; }
  .mono { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre; }
  #topk tr.selected td { background: #fff8c5; }
  .bar { display: inline-block; height: 8px; background: #2da44e; vertical-align: middle; margin-right: 4px; }
  #logit-lens td { min-width: 48px; max-width: 90px; overflow: hidden; }
  #attention-heatmap text { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 11px; }
</style>
</head>
<body>
<h1>__TITLE__</h1>
<div class="meta" id="summary"></div>

<h2>Tokens</h2>
<div id="tokens"></div>

<h2>Attention</h2>
<div class="controls">
  <label>layer <select id="layer-select"></select></label>
  <input type="range" id="layer-slider" min="0" value="0">
  <label>head <select id="head-select"></select></label>
  <span class="meta">row = query (attending), column = key (attended to); hover a cell for its weight</span>
</div>
<div class="columns">
  <svg id="attention-heatmap" xmlns="http://www.w3.org/2000/svg"></svg>
  <div>
    <h2 style="margin-top:0">Top-k next tokens</h2>
    <table id="topk"></table>
  </div>
</div>

<h2>Logit lens</h2>
<div class="meta">Each row: the residual stream after that block, passed through the final norm and the unembedding.
Cell: the top next-token guess at that position; colour: its probability.</div>
<table id="logit-lens"></table>

<script type="application/json" id="report-data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("report-data").textContent);
const SVG_NS = "http://www.w3.org/2000/svg";
const T = DATA.tokens.length;
let selected = T - 1;

// Colour ramp from white to dark blue (matplotlib's "Blues").
const BLUES = [[247, 251, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181], [8, 48, 107]];
function blue(v) {
  v = Math.max(0, Math.min(1, v)) * (BLUES.length - 1);
  const i = Math.min(Math.floor(v), BLUES.length - 2), f = v - i;
  const c = BLUES[i].map((a, k) => Math.round(a + (BLUES[i + 1][k] - a) * f));
  return "rgb(" + c.join(",") + ")";
}
function show(token) {  // whitespace made visible: " the" and "the" are different tokens
  return token.replace(/ /g, "\u00b7").replace(/\n/g, "\\n").replace(/\t/g, "\\t") || "\u2205";
}
function el(tag, attrs, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG_NS, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

function drawSummary() {
  const c = DATA.config;
  document.getElementById("summary").textContent =
    `model ${DATA.model}: ${c.n_layers} layers, ${c.n_heads} heads (${c.n_kv_heads} kv), d_model ${c.d_model}, ` +
    `vocab ${c.vocab_size}, positions ${c.positions}; ${T} tokens`;
}

function drawTokens() {
  const box = document.getElementById("tokens");
  DATA.tokens.forEach((tok, i) => {
    const span = el("span", {"class": "token", "data-pos": i, "title": `position ${i}, id ${DATA.ids[i]}`}, tok);
    span.addEventListener("click", () => { selected = i; refreshSelection(); });
    box.appendChild(span);
  });
}

function drawTopk() {
  const table = document.getElementById("topk");
  const head = el("tr");
  ["pos", "token"].concat(DATA.topk[0].map((_, r) => "#" + (r + 1))).forEach(h => head.appendChild(el("th", {}, h)));
  table.appendChild(head);
  DATA.topk.forEach((row, i) => {
    const tr = el("tr", {"data-pos": i});
    tr.appendChild(el("td", {}, String(i)));
    tr.appendChild(el("td", {"class": "mono"}, show(DATA.tokens[i])));
    row.forEach(p => {
      const td = el("td", {"class": "mono", "title": `id ${p.id}: p = ${p.prob.toFixed(4)}`});
      td.appendChild(el("span", {"class": "bar", "style": `width:${Math.max(1, Math.round(p.prob * 40))}px`}));
      td.appendChild(document.createTextNode(`${show(p.token)} ${(100 * p.prob).toFixed(1)}%`));
      tr.appendChild(td);
    });
    tr.addEventListener("click", () => { selected = i; refreshSelection(); });
    table.appendChild(tr);
  });
}

function currentMatrix() {
  const layer = +document.getElementById("layer-select").value;
  const head = document.getElementById("head-select").value;
  const heads = DATA.attention[layer];  // rows stored up to the diagonal (causal)
  const full = h => h.map(row => row.concat(new Array(T - row.length).fill(0)));
  if (head !== "mean") return full(heads[+head]);
  return full(heads[0].map((row, q) => row.map((_, k) => heads.reduce((s, h) => s + h[q][k], 0) / heads.length)));
}

function drawHeatmap() {
  const svg = document.getElementById("attention-heatmap");
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const m = currentMatrix();
  const labels = DATA.tokens.map(show);
  const longest = Math.min(14, Math.max(...labels.map(s => s.length)));
  const margin = 12 + 7 * longest, cell = Math.max(10, Math.min(32, Math.floor(560 / T)));
  const size = margin + cell * T + 4;
  svg.setAttribute("width", size); svg.setAttribute("height", size);
  svg.setAttribute("viewBox", `0 0 ${size} ${size}`);
  svg.setAttribute("data-layer", document.getElementById("layer-select").value);
  svg.setAttribute("data-head", document.getElementById("head-select").value);
  m.forEach((row, q) => row.forEach((v, k) => {
    const rect = el("svg:rect", {"class": "cell", "x": margin + k * cell, "y": margin + q * cell,
      "width": cell, "height": cell, "fill": blue(v), "stroke": q === selected ? "#bf8700" : "#fff",
      "stroke-width": q === selected ? 1.5 : 0.5, "data-query": q, "data-key": k, "data-weight": v.toFixed(3)});
    rect.appendChild(el("svg:title", {}, `${labels[q]} \u2192 ${labels[k]}: ${v.toFixed(3)}`));
    svg.appendChild(rect);
  }));
  labels.forEach((lab, i) => {
    const short = lab.length > 14 ? lab.slice(0, 13) + "\u2026" : lab;
    svg.appendChild(el("svg:text", {"x": margin - 4, "y": margin + i * cell + cell / 2 + 4, "text-anchor": "end",
      "class": "row-label"}, short));
    const x = margin + i * cell + cell / 2 + 4, y = margin - 4;
    svg.appendChild(el("svg:text", {"x": x, "y": y, "transform": `rotate(-90 ${x} ${y})`, "class": "col-label"},
                       short));
  });
}

function drawControls() {
  const layerSelect = document.getElementById("layer-select"), slider = document.getElementById("layer-slider");
  const headSelect = document.getElementById("head-select");
  DATA.attention.forEach((_, l) => layerSelect.appendChild(el("option", {"value": l}, String(l))));
  DATA.attention[0].forEach((_, h) => headSelect.appendChild(el("option", {"value": h}, String(h))));
  headSelect.appendChild(el("option", {"value": "mean"}, "mean of heads"));
  slider.max = DATA.attention.length - 1;
  layerSelect.addEventListener("change", () => { slider.value = layerSelect.value; drawHeatmap(); });
  slider.addEventListener("input", () => { layerSelect.value = slider.value; drawHeatmap(); });
  headSelect.addEventListener("change", drawHeatmap);
  // A link can open a given map: report.html#layer=3&head=1 (head may be "mean").
  const wanted = new URLSearchParams(location.hash.slice(1));
  if (wanted.has("layer") && +wanted.get("layer") < DATA.attention.length) {
    layerSelect.value = slider.value = wanted.get("layer");
  }
  if (wanted.has("head")) headSelect.value = wanted.get("head");
  if (headSelect.selectedIndex < 0) headSelect.value = "0";
}

function drawLogitLens() {
  const table = document.getElementById("logit-lens");
  const head = el("tr");
  head.appendChild(el("th", {}, "layer \\ input"));
  DATA.tokens.forEach(t => head.appendChild(el("th", {"class": "mono"}, show(t))));
  table.appendChild(head);
  DATA.lens.labels.forEach((label, l) => {
    const tr = el("tr");
    tr.appendChild(el("th", {}, label));
    DATA.lens.tokens[l].forEach((tok, t) => {
      const p = DATA.lens.probs[l][t];
      tr.appendChild(el("td", {"class": "mono lens-cell", "title": `p = ${p.toFixed(4)}`,
        "style": `background:${blue(p)};color:${p > 0.55 ? "#fff" : "#000"}`}, show(tok)));
    });
    table.appendChild(tr);
  });
}

function refreshSelection() {
  document.querySelectorAll("#tokens .token").forEach(s => s.classList.toggle("selected", +s.dataset.pos === selected));
  document.querySelectorAll("#topk tr[data-pos]").forEach(
    r => r.classList.toggle("selected", +r.dataset.pos === selected));
  drawHeatmap();
}

drawSummary();
drawTokens();
drawControls();
drawTopk();
drawLogitLens();
refreshSelection();
</script>
</body>
</html>
"""
