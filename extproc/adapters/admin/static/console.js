// The console: polls /console/data every two seconds and draws the fleet. No framework, no build.
"use strict";

const SVG = "http://www.w3.org/2000/svg";
const COLORS = { estimated: "#2563eb", reported: "#16a34a", round_robin: "#9ca3af" };

function el(tag, attrs = {}, text = "") {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== "") node.textContent = text;
  return node;
}

function pct(x) { return (100 * x).toFixed(1) + "%"; }

function drawFleet(replicas) {
  const body = document.querySelector("#fleet tbody");
  body.replaceChildren();
  for (const r of replicas) {
    const tr = el("tr", { "data-replica": r.name });
    const cells = [
      [r.name], [r.role || "both"], [r.health.toFixed(2), r.health < 0.5], [r.rotation_state, !r.in_rotation],
      [r.cordon || "-", !!r.cordon], [r.inflight], [r.queue], [pct(r.kv_usage)], [r.sessions_pinned], [r.kv_events],
    ];
    for (const [value, bad] of cells) tr.append(el("td", bad ? { class: "bad" } : {}, String(value)));
    body.append(tr);
  }
}

function heatColor(v) {
  // 0 -> pale, 1 -> deep red.
  const t = Math.max(0, Math.min(1, v));
  return `rgb(${Math.round(250 - 40 * t)},${Math.round(245 - 200 * t)},${Math.round(240 - 210 * t)})`;
}

function drawHeatmap(replicas, history) {
  const svg = document.getElementById("heatmap");
  const metric = document.getElementById("heat-metric").value;
  svg.replaceChildren();
  const width = svg.clientWidth || 1200, label = 90, rowH = Math.max(10, Math.min(28, 140 / Math.max(1, replicas.length)));
  svg.setAttribute("height", String(rowH * replicas.length + 4));
  const cols = Math.max(1, history.length), cellW = (width - label) / cols;
  // Queue and sessions are scaled to the fleet's highest value in the window (KV usage is a share).
  const top = Math.max(1, ...history.flatMap((s) => Object.values(s[metric])));
  replicas.forEach((r, i) => {
    svg.append(el("svg:text", { x: 0, y: i * rowH + rowH * 0.7, "font-size": 11 }, r.name));
    history.forEach((s, j) => {
      const v = s[metric][r.name] || 0;
      const scaled = metric === "kv" ? v : v / top;
      const rect = el("svg:rect", { x: label + j * cellW, y: i * rowH, width: Math.ceil(cellW), height: rowH - 1, fill: heatColor(scaled) });
      rect.append(el("svg:title", {}, `${r.name}: ${metric === "kv" ? pct(v) : v}`));
      svg.append(rect);
    });
  });
}

function drawHitRatio(history) {
  const svg = document.getElementById("hitratio");
  svg.replaceChildren();
  const width = svg.clientWidth || 560, height = 190, left = 34, bottom = 16, h = height - bottom - 6;
  for (const y of [0, 0.5, 1]) {
    const py = 6 + h * (1 - y);
    svg.append(el("svg:line", { x1: left, x2: width, y1: py, y2: py, stroke: "#eef0f3" }));
    svg.append(el("svg:text", { x: 0, y: py + 4, "font-size": 10 }, pct(y)));
  }
  const n = history.length, step = n > 1 ? (width - left - 8) / (n - 1) : 0;
  for (const [series, color] of Object.entries(COLORS)) {
    const pts = [];
    history.forEach((s, i) => { if (s[series] !== null) pts.push([left + i * step, 6 + h * (1 - s[series]), s[series]]); });
    if (pts.length > 1) {
      svg.append(el("svg:polyline", { points: pts.map((p) => `${p[0]},${p[1]}`).join(" "), fill: "none", stroke: color, "stroke-width": 2 }));
    }
    for (const [x, y, v] of pts) {
      const dot = el("svg:circle", { cx: x, cy: y, r: 2.5, fill: color, class: "pt", "data-series": series });
      dot.append(el("svg:title", {}, `${series}: ${pct(v)}`));
      svg.append(dot);
    }
  }
}

function drawReasons(decisions) {
  const box = document.getElementById("reasons");
  box.replaceChildren();
  const top = Math.max(1, ...Object.values(decisions));
  for (const [reason, n] of Object.entries(decisions)) {
    const row = el("div", { class: "bar", "data-reason": reason });
    row.append(el("span", { class: "name" }, reason));
    row.append(el("span", { class: "fill", style: `width:${Math.max(2, 260 * n / top)}px` }));
    row.append(el("span", { class: "n" }, String(n)));
    box.append(row);
  }
}

function drawHotKeys(hot) {
  const section = document.getElementById("hot-section");
  section.hidden = hot === null || hot === undefined;
  const body = document.querySelector("#hot tbody");
  body.replaceChildren();
  for (const h of hot || []) {
    const row = el("tr");
    row.append(el("td", {}, h.key), el("td", {}, String(h.rate)), el("td", {}, String(h.replicas)));
    body.append(row);
  }
}

async function refresh() {
  try {
    const resp = await fetch("/console/data", { cache: "no-store" });
    const data = await resp.json();
    drawFleet(data.replicas);
    drawHeatmap(data.replicas, data.history);
    drawHitRatio(data.history);
    drawReasons(data.decisions);
    drawHotKeys(data.hot_keys);
    document.getElementById("status").textContent =
      `${data.replicas.length} replicas, ${data.history.length} samples every ${data.interval_s}s, updated ${new Date(data.time * 1000).toLocaleTimeString()}`;
  } catch (err) {
    document.getElementById("status").textContent = "cannot reach /console/data: " + err;
  }
}

async function explain(event) {
  event.preventDefault();
  const session = document.getElementById("explain-session").value.trim();
  const headers = session ? { "x-session-id": session } : {};
  const resp = await fetch("/console/explain", {
    method: "POST", body: JSON.stringify({ headers, body: document.getElementById("explain-body").value }),
  });
  const out = document.getElementById("explain-result");
  const r = await resp.json();
  out.replaceChildren();
  if (r.error) { out.textContent = r.error; return; }
  out.append(el("div", {}, `-> ${r.replica || "none"} (${r.reason}); matched ${r.matched_blocks || 0}/${r.total_blocks || 0} blocks, ~${r.predicted_uncached_tokens || 0} uncached tokens; order ${(r.order || []).join(" > ")}`));
  const table = el("table");
  const head = el("tr");
  head.append(...["replica", "rank", "total", "matched", "uncached", "scores / removed"].map((h) => el("th", {}, h)));
  table.append(head);
  const order = (x) => { const k = x.rank ?? 0; return k < 0 ? 1e9 : k; };
  for (const x of (r.replicas || []).sort((a, b) => order(a) - order(b))) {
    const parts = x.removed_by ? `${x.removed_by}: ${x.removed_why}`
      : (x.scores || []).filter((p) => p.contribution).map((p) => `${p.scorer} ${p.contribution.toFixed(2)}`).join(", ");
    const tr = el("tr");
    for (const v of [x.replica, (x.rank ?? 0) < 0 ? "-" : (x.rank ?? 0), (x.total || 0).toFixed(3), `${x.matched_blocks || 0} (${x.match_source})`, x.predicted_uncached_tokens || 0, parts]) tr.append(el("td", {}, String(v)));
    table.append(tr);
  }
  out.append(table);
}

document.getElementById("explain-form").addEventListener("submit", explain);
document.getElementById("heat-metric").addEventListener("change", refresh);
refresh();
setInterval(refresh, 2000);
