// The dedloc dashboard: polls /api/snapshot (the control API's own answers) and draws them.
// Everything that comes from the daemon or its peers is set as text, never parsed as HTML.
"use strict";

const POLL_MS = 1500;
const FETCH_TIMEOUT_MS = 5000;
const SHORT_ID = 12;
const SVG_NS = "http://www.w3.org/2000/svg";
const $ = (selector, root = document) => root.querySelector(selector);

function short(id) { return id ? String(id).slice(0, SHORT_ID) : "—"; }
function number(value) { return typeof value === "number" && Number.isFinite(value) ? value : null; }
function fixed(value, digits) { const n = number(value); return n === null ? "—" : n.toFixed(digits); }
function count(value) { const n = number(value); return n === null ? "—" : Math.round(n).toLocaleString("en-US"); }

function duration(seconds) {
  const s = number(seconds);
  if (s === null) return "—";
  if (s < 1) return `${s.toFixed(2)} s`;
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

function bytes(value) {
  let n = number(value);
  if (n === null) return "—";
  for (const unit of ["B", "KiB", "MiB", "GiB"]) {
    if (n < 1024 || unit === "GiB") return unit === "B" ? `${n} B` : `${n.toFixed(1)} ${unit}`;
    n /= 1024;
  }
  return "—";
}

function compact(value) {
  const a = Math.abs(value);
  if (a >= 1e6) return `${(value / 1e6).toPrecision(3)}M`;
  if (a >= 1e3) return `${(value / 1e3).toPrecision(3)}k`;
  return a >= 0.01 || a === 0 ? value.toPrecision(3) : value.toExponential(1);
}

function rate(value) { const n = number(value); return n ? `${bytes(n)}/s` : "none"; }

function setText(root, field, text) {
  const element = root.querySelector(`[data-field="${field}"]`);
  if (element) element.textContent = text;
  return element;
}

function peerCell(row, id, own) {
  const cell = row.insertCell();
  const span = document.createElement("span");
  span.className = "peer";
  span.title = id;
  span.textContent = short(id) + (id === own ? " (this node)" : "");
  cell.appendChild(span);
}

function fillTable(table, rows, build) {
  const body = table.tBodies[0];
  body.replaceChildren();
  for (const item of rows) build(body.insertRow(), item);
}

function renderNode(snapshot) {
  const info = snapshot.node || {};
  const ownId = info.peer_id || "";
  $("#header-peer-id").textContent = short(ownId);
  const peerId = $("#node-peer-id");
  peerId.textContent = ownId || "—";
  peerId.dataset.peerId = ownId;
  $("#node-version").textContent = info.version || "—";
  $("#node-uptime").textContent = duration(info.uptime_seconds);
  $("#node-reachable").textContent = info.reachable === null || info.reachable === undefined
    ? "not known yet" : (info.reachable ? "yes" : "no (behind a NAT: relayed)");
  const dht = info.dht || {};
  $("#node-dht").textContent = `${dht.mode || "—"}, ${dht.joined ? "joined" : "not joined"}, `
    + `${count(dht.routing_table_size)} in the routing table`;
  $("#node-relays").textContent = (info.relays || []).map(short).join(", ") || "none";

  const bandwidth = snapshot.bandwidth || {};
  $("#bandwidth-up").textContent = rate(bandwidth.upload_bytes_per_second);
  $("#bandwidth-down").textContent = rate(bandwidth.download_bytes_per_second);
  $("#bandwidth-throttled").textContent = `↑ ${duration(bandwidth.throttled_seconds_up)} `
    + `↓ ${duration(bandwidth.throttled_seconds_down)}`;
  const measured = (snapshot.averaging || {}).bandwidth || {};
  $("#bandwidth-measured").textContent = `↑ ${rate(measured.upload_bytes_per_second)} `
    + `↓ ${rate(measured.download_bytes_per_second)}`;

  const links = snapshot.peers || [];
  $("#links-count").textContent = `(${links.length})`;
  fillTable($("#links"), links, (row, link) => {
    row.dataset.peerId = link.peer_id;
    row.dataset.kind = link.kind;
    peerCell(row, link.peer_id, ownId);
    row.insertCell().textContent = link.kind;
    row.insertCell().textContent = link.outbound ? "out" : "in";
    row.insertCell().textContent = number(link.rtt_ms) === null ? "—" : `${link.rtt_ms.toFixed(1)} ms`;
    row.insertCell().textContent = bytes(link.bytes_in);
    row.insertCell().textContent = bytes(link.bytes_out);
    row.insertCell().textContent = duration(snapshot.time - link.opened_at);
  });
  return ownId;
}

function plot(svg, series) {
  // series: [{points: [[x, y], ...], cls}]; drawn on shared axes, with the ranges as labels.
  svg.replaceChildren();
  const all = series.flatMap((s) => s.points);
  svg.dataset.points = String(all.length);
  if (all.length === 0) {
    const text = document.createElementNS(SVG_NS, "text");
    text.setAttribute("x", "200"); text.setAttribute("y", "85"); text.setAttribute("text-anchor", "middle");
    text.setAttribute("class", "label");
    text.textContent = "no epoch yet";
    svg.appendChild(text);
    return;
  }
  const xs = all.map((p) => p[0]); const ys = all.map((p) => p[1]);
  let [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.1 || 1; y1 += Math.abs(y1) * 0.1 || 1; }
  const [left, right, top, bottom] = [46, 395, 8, 140];
  const px = (x) => left + ((x - x0) / (x1 - x0)) * (right - left);
  const py = (y) => bottom - ((y - y0) / (y1 - y0)) * (bottom - top);
  const axis = document.createElementNS(SVG_NS, "path");
  axis.setAttribute("class", "axis");
  axis.setAttribute("d", `M${left},${top} V${bottom} H${right}`);
  svg.appendChild(axis);
  const labels = [[left - 4, top + 8, "end", compact(y1)], [left - 4, bottom, "end", compact(y0)],
    [left, 155, "start", `epoch ${Math.round(x0)}`], [right, 155, "end", `epoch ${Math.round(x1)}`]];
  for (const [x, y, anchor, label] of labels) {
    const text = document.createElementNS(SVG_NS, "text");
    text.setAttribute("x", x); text.setAttribute("y", y); text.setAttribute("text-anchor", anchor);
    text.setAttribute("class", "label");
    text.textContent = label;
    svg.appendChild(text);
  }
  for (const s of series) {
    if (s.points.length === 0) continue;
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("class", s.cls);
    line.setAttribute("points", s.points.map(([x, y]) => `${px(x).toFixed(1)},${py(y).toFixed(1)}`).join(" "));
    svg.appendChild(line);
  }
}

function throughputSeries(run) {
  // Per epoch: the run's samples/s (its target batch over the epoch's time) and this peer's own.
  const history = run.epoch_history || [];
  const runPoints = []; const ownPoints = [];
  for (let i = 1; i < history.length; i++) {
    const seconds = history[i].applied_at - history[i - 1].applied_at;
    if (!(seconds > 0)) continue;
    runPoints.push([history[i].epoch, run.target_batch_size / seconds]);
    ownPoints.push([history[i].epoch, history[i].samples / seconds]);
  }
  return [{points: runPoints, cls: "run-series"}, {points: ownPoints, cls: "own-series"}];
}

function lossSeries(run) {
  const losses = (run.epoch_losses || []).filter((v) => number(v) !== null);
  const last = (number(run.epoch) || losses.length) - 1;  // the newest closed epoch
  return [{points: losses.map((loss, i) => [last - (losses.length - 1 - i), loss]), cls: "loss"}];
}

function renderRun(section, run, snapshot, ownId) {
  const collaborative = Boolean(run.collaborative);
  const runEpoch = number(run.run_epoch) ?? number(run.epoch) ?? 0;
  section.dataset.run = run.name;
  section.dataset.epoch = String(run.epoch);
  section.dataset.runEpoch = String(runEpoch);
  setText(section, "name", run.name);
  const state = setText(section, "state", run.phase && run.state === "running" ? `${run.state} · ${run.phase}` : run.state);
  state.dataset.state = run.state;
  setText(section, "kind", `${run.role || "trainer"} · ${run.workload || ""}${collaborative ? " · collaborative" : ""}`);
  setText(section, "run-epoch", String(runEpoch));
  setText(section, "epoch-detail", (run.epochs ? `of ${run.epochs}` : "")
    + (collaborative ? ` · this peer at ${run.epoch}` : ""));
  const sync = run.sync || {};
  const local = sync.mode === "local";
  // a local-update run steps (an outer step) after inner_steps target batches
  const target = (number(run.target_batch_size) || 0) * (local ? (number(sync.inner_steps) || 1) : 1);
  const done = number(run.run_samples_accumulated) ?? number(run.accumulated) ?? 0;
  const share = target > 0 ? Math.min(1, done / target) : 0;
  section.querySelector('[data-field="progress-bar"] .fill').style.width = `${(share * 100).toFixed(1)}%`;
  setText(section, "progress-text", `${count(done)} / ${count(target)} samples toward the next ${local ? "outer " : ""}step `
    + `(${(share * 100).toFixed(0)}%) · ETA ${duration(run.run_eta_seconds)}`);
  setText(section, "loss", `${fixed(run.loss, 4)} (first ${fixed(run.loss_first, 4)})`);
  setText(section, "throughput", `run ${fixed(run.run_samples_per_second, 1)} · this peer ${fixed(run.samples_per_second, 1)}`);
  setText(section, "peers", collaborative ? `${count(run.run_peers)} trainers, ${count(run.run_aux_peers)} aux` : "—");
  const last = run.last_round;
  setText(section, "last-round", last ? `group ${last.group_size} · ${duration(last.seconds)} · `
    + `↑${bytes(last.bytes_sent)} ↓${bytes(last.bytes_received)}${(last.failed_parts || []).length ? " · failed" : ""}` : "none yet");
  setText(section, "overhead", duration(run.epoch_overhead_seconds));
  setText(section, "sync", local
    ? `local updates, H ${count(sync.inner_steps)} · outer step ${count(sync.outer_step)} · inner step `
      + `${count(sync.inner_step)} · ↑${bytes(sync.bytes_sent_per_step)}/outer step · compression ×${fixed(sync.compression_ratio, 1)}`
    : `gradients · ↑${bytes(sync.bytes_sent_per_step)}/step · compression ×${fixed(sync.compression_ratio, 1)}`);
  const worker = run.worker || {};
  setText(section, "worker", `${worker.state || "—"}${worker.pid ? ` (pid ${worker.pid})` : ""} · restarts ${count(run.restarts ?? 0)}`);

  plot(section.querySelector('[data-plot="loss"]'), lossSeries(run));
  plot(section.querySelector('[data-plot="throughput"]'), throughputSeries(run));

  const linkKinds = new Map((snapshot.peers || []).map((link) => [link.peer_id, link.kind]));
  const alive = run.live_peers || Object.keys(run.contributions || {}).map((peer_id) => ({peer_id}));
  fillTable(section.querySelector('[data-table="alive-peers"]'), alive, (row, peer) => {
    row.dataset.peerId = peer.peer_id;
    if (peer.peer_id === ownId) row.className = "self";
    peerCell(row, peer.peer_id, ownId);
    row.insertCell().textContent = peer.role || "—";
    row.insertCell().textContent = peer.epoch ?? "—";
    row.insertCell().textContent = fixed(peer.samples_per_second, 1);
    row.insertCell().textContent = peer.peer_id === ownId ? "self" : (linkKinds.get(peer.peer_id) || "via DHT");
    row.insertCell().textContent = number(peer.reported_at) === null ? "—" : `${duration(snapshot.time - peer.reported_at)} ago`;
  });

  const since = new Map((run.live_peers || []).map((peer) => [peer.peer_id, peer.started_at]));
  const contributions = Object.entries(run.contributions || {}).sort((a, b) => b[1] - a[1] || (a[0] < b[0] ? -1 : 1));
  const total = contributions.reduce((sum, [, samples]) => sum + (number(samples) || 0), 0);
  let rank = 0;
  fillTable(section.querySelector('[data-table="leaderboard"]'), contributions, (row, [peerId, samples]) => {
    row.dataset.peerId = peerId;
    row.dataset.samples = String(samples);
    if (peerId === ownId) row.className = "self";
    row.insertCell().textContent = String(++rank);
    peerCell(row, peerId, ownId);
    row.insertCell().textContent = count(samples);
    row.insertCell().textContent = total > 0 ? `${((100 * samples) / total).toFixed(1)}%` : "—";
    const started = number(since.get(peerId));
    row.insertCell().textContent = started === null ? "—" : duration(snapshot.time - started);
  });
}

function renderRuns(snapshot, ownId) {
  const container = $("#runs");
  const runs = snapshot.runs || [];
  $("#no-runs").hidden = runs.length > 0;
  const sections = new Map([...container.querySelectorAll("section.run")].map((s) => [s.dataset.run, s]));
  for (const run of runs) {
    let section = sections.get(run.name);
    if (!section) {
      section = $("#run-template").content.firstElementChild.cloneNode(true);
      section.dataset.run = run.name;
      container.appendChild(section);
    }
    sections.delete(run.name);
    renderRun(section, run, snapshot, ownId);
  }
  for (const gone of sections.values()) gone.remove();
}

async function poll() {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), FETCH_TIMEOUT_MS);
  try {
    const response = await fetch("/api/snapshot", {cache: "no-store", signal: controller.signal});
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const snapshot = await response.json();
    const ownId = renderNode(snapshot);
    renderRuns(snapshot, ownId);
    document.body.dataset.state = "live";
    document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
    $("#status-line").textContent = `live · updated ${new Date(snapshot.time * 1000).toLocaleTimeString()}`;
  } catch (error) {
    document.body.dataset.state = "offline";
    $("#status-line").textContent = `the daemon does not answer (${error.message || error}); retrying`;
  } finally {
    clearTimeout(timer);
    setTimeout(poll, POLL_MS);
  }
}

poll();
