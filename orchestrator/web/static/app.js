// orchestrate dashboard: live sections, charts (uPlot), the live log, Cancel. No framework, nothing from the network.
// Every second (a job's page: twice) the page asks its own URL with ?part=1 for its live sections (JSON {id: html}) and swaps in those
// that changed; a job page also asks for what its heartbeat files and logs gained since the last look.
"use strict";
(function () {
  const body = document.body;
  // a job's page looks twice a second (what a heartbeat changes is on it well within 2 s), the others once
  const POLL_MS = body.classList.contains("job") ? 500 : 1000;
  const tokenMeta = document.querySelector('meta[name="orchestrate-token"]');
  const token = tokenMeta ? tokenMeta.content : null;
  const updated = document.getElementById("updated");
  const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                  "#7f7f7f", "#bcbd22"];

  function stamp(ok) {
    if (updated) updated.textContent = (ok ? "live, updated " : "not reachable, last try ") +
      new Date().toLocaleTimeString();
    body.dataset.updated = String(Date.now());
  }

  async function getJSON(url) {
    const r = await fetch(url, {credentials: "same-origin", cache: "no-store"});
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  function partURL() {
    const u = new URL(location.href);
    u.searchParams.set("part", "1");
    return u.toString();
  }

  async function refreshSections() {
    const parts = await getJSON(partURL());
    for (const [id, html] of Object.entries(parts)) {
      const el = document.getElementById(id);
      if (el && el.dataset.html !== html) {
        el.innerHTML = html;
        el.dataset.html = html;
      }
    }
  }

  // ---------------------------------------------------------------------------------------- charts
  function makeChart(el, label, names, height) {
    if (!el || typeof uPlot === "undefined") return null;
    const series = [{label: "step"}].concat(names.map((n, i) => ({
      label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
      points: {show: false}})));
    const width = Math.max(300, el.clientWidth || 600);
    const chart = new uPlot({width: width, height: height || 240, series: series,
      scales: {x: {time: false}}, axes: [{label: "step", incrs: STEP_INCRS}, {label: label, size: 70}],
      legend: {live: false}}, [[]].concat(names.map(() => [])), el);
    el.dataset.points = "0";
    return chart;
  }

  // per-name maps of step -> value, turned into uPlot's aligned columns
  function aligned(maps) {
    const steps = new Set();
    maps.forEach(m => m.forEach((_, s) => steps.add(s)));
    const xs = Array.from(steps).sort((a, b) => a - b);
    return [xs].concat(maps.map(m => xs.map(s => (m.has(s) ? m.get(s) : null))));
  }

  function setChart(chart, el, maps, names) {
    if (!chart) return;
    const d = aligned(maps);
    chart.setData(d);
    let n = 0;
    maps.forEach(m => { n += m.size; });
    el.dataset.points = String(n);
    el.dataset.series = String(names.filter((_, i) => maps[i].size > 0).length);
  }

  // ---------------------------------------------------------------------------------------- a job
  function jobPage() {
    const job = body.dataset.job;
    const lossEl = document.getElementById("chart-loss");
    const speedEl = document.getElementById("chart-speed");
    let loss = null, speed = null, ranks = [], lossMaps = [], speedMaps = [], offsets = null;

    async function charts() {
      const url = "/api/jobs/" + encodeURIComponent(job) + "/series" +
        (offsets ? "?off=" + Object.entries(offsets).map(([r, o]) => r + ":" + o).join(",") : "");
      const d = await getJSON(url);
      if (!loss) {
        ranks = Object.keys(d.ranks).map(Number).sort((a, b) => a - b);
        const names = ranks.map(r => "rank " + r);
        lossMaps = ranks.map(() => new Map());
        speedMaps = ranks.map(() => new Map());
        loss = makeChart(lossEl, "loss", names);
        speed = makeChart(speedEl, "tokens/s", names);
        const drew = document.getElementById("drew");
        if (drew && d.drew) drew.textContent = "drawn: " + d.drew;
      }
      offsets = offsets || {};
      ranks.forEach((r, i) => {
        const got = d.ranks[r];
        if (!got) return;
        got.loss.forEach(([s, v]) => { if (!lossMaps[i].has(s)) lossMaps[i].set(s, v); });
        got.speed.forEach(([s, v]) => { if (!speedMaps[i].has(s)) speedMaps[i].set(s, v); });
        offsets[r] = got.offset;
      });
      const names = ranks.map(r => "rank " + r);
      setChart(loss, lossEl, lossMaps, names);
      setChart(speed, speedEl, speedMaps, names);
    }

    // the live log: the last lines first, then what came since, filtered by rank / node / text
    const pre = document.getElementById("log-lines");
    const rankSel = document.getElementById("log-rank");
    const nodeIn = document.getElementById("log-node");
    const textIn = document.getElementById("log-text");
    const follow = document.getElementById("log-follow");
    let logOff = null, logKey = "";
    const MAX_LINES = 5000;

    function logQuery() {
      const p = new URLSearchParams();
      if (rankSel && rankSel.value !== "") p.set("rank", rankSel.value);
      else if (nodeIn && nodeIn.value !== "") p.set("node", nodeIn.value);
      if (textIn && textIn.value) p.set("q", textIn.value);
      return p;
    }

    async function logs() {
      if (!pre) return;
      const p = logQuery();
      const key = p.toString();
      if (key !== logKey) { logKey = key; logOff = null; pre.textContent = ""; }
      if (logOff) p.set("off", Object.entries(logOff).map(([n, o]) => n + ":" + o).join(","));
      const d = await getJSON("/api/jobs/" + encodeURIComponent(job) + "/log?" + p.toString());
      if (key !== logKey) return;  // (the filter changed meanwhile)
      logOff = d.offsets;
      if (d.lines.length) {
        const lines = (pre.textContent ? pre.textContent.split("\n") : []).concat(d.lines);
        pre.textContent = lines.slice(-MAX_LINES).join("\n");
        pre.dataset.lines = String(Math.min(lines.length, MAX_LINES));
        if (!follow || follow.checked) pre.scrollTop = pre.scrollHeight;
      }
    }
    [rankSel, nodeIn, textIn].forEach(el => el && el.addEventListener("input", () => logs().catch(() => {})));

    document.addEventListener("click", async ev => {
      const b = ev.target.closest("button[data-cancel]");
      if (!b) return;
      if (!window.confirm("Cancel job " + b.dataset.cancel + "? Every process on every node is stopped.")) return;
      b.disabled = true;
      const out = document.getElementById("cancel-result");
      if (out) out.textContent = "cancelling...";
      try {
        const r = await fetch("/api/jobs/" + encodeURIComponent(b.dataset.cancel) + "/cancel", {
          method: "POST", credentials: "same-origin", headers: {"X-Orchestrate-Token": token || ""}});
        const d = await r.json();
        const o2 = document.getElementById("cancel-result");
        if (o2) o2.textContent = r.ok ? "job " + d.job + " " + d.state : "refused: " + (d.error || r.status);
      } catch (e) {
        const o2 = document.getElementById("cancel-result");
        if (o2) o2.textContent = "failed: " + e;
      }
    });
    return async () => { await Promise.all([charts(), logs()]); };
  }

  // ---------------------------------------------------------------------------------------- a sweep
  function sweepPage() {
    const el = document.getElementById("chart-sweep");
    let chart = null, labels = [];
    return async () => {
      const d = await getJSON("/api/sweeps/" + encodeURIComponent(body.dataset.sweep) + "/curves");
      const names = d.curves.map(c => c.label);
      if (!chart || names.join("|") !== labels.join("|")) {
        if (chart) chart.destroy();
        labels = names;
        chart = makeChart(el, "loss (rank 0)", names, 320);
      }
      setChart(chart, el, d.curves.map(c => new Map(c.points.map(([s, v]) => [s, v]))), names);
      const drew = document.getElementById("drew");
      if (drew) drew.textContent = d.downsampled.length ? "downsampled: " + d.downsampled.join(", ") : "";
    };
  }

  const extra = body.classList.contains("job") ? jobPage() : body.classList.contains("sweep") ? sweepPage() : null;
  const hasLive = document.querySelector("[data-live]") !== null;

  async function tick() {
    let ok = true;
    try {
      await Promise.all([hasLive ? refreshSections() : null, extra ? extra() : null]);
    } catch (e) {
      ok = false;
    }
    stamp(ok);
    setTimeout(tick, POLL_MS);
  }
  document.querySelectorAll("[data-live]").forEach(el => { el.dataset.html = el.innerHTML; });
  window.addEventListener("load", tick);
})();
