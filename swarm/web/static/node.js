// A node's own page: polls /status and /api/history of this node process every 2 s.
"use strict";

(() => {
  const { el, fill, num, rate, money, duration, any, getJSON, Chart, kv } = RS;
  const state = { status: null, seq: 0, samples: [], renders: 0, lastOk: null, charts: {} };
  window.RSNode = state;

  function render(s) {
    fill(document.getElementById("fp"), String(s.fingerprint || "–").replace(/^ed25519:/, "").slice(0, 12));
    document.getElementById("fp").title = (s.fingerprint || "") + "\npeer " + (s.peer_id || "");
    fill(document.getElementById("uptime"), duration(s.uptime_s));
    const cards = [
      ["state", "state", any(s.state), s.doing || ""],
      ["tokens per second", "tokens_per_s", num(s.tokens_per_s), num(s.tokens_generated) + " tokens so far"],
      ["policy loaded", "loaded_version", s.loaded_version === null || s.loaded_version === undefined ? RS.DASH : "v" + s.loaded_version,
        "holding " + (Array.isArray(s.versions_held) && s.versions_held.length ? s.versions_held.map((v) => "v" + v).join(" ") : "none")],
      ["leases accepted", "leases_accepted", num(s.leases_accepted), num(s.samples_accepted) + " samples"],
      ["leases rejected", "leases_rejected", num(s.leases_rejected), s.last_reject ? "last: " + s.last_reject : "none"],
      ["leases released", "leases_released", num(s.leases_released), "given back unfinished"],
    ];
    fill(document.getElementById("kpis"), cards.map(([label, key, value, sub]) =>
      el("div", { class: "kpi" }, el("div", { class: "label" }, label),
        el("div", { class: "value", "data-key": key }, value), el("div", { class: "sub", title: sub }, sub))));
    kv(document.getElementById("doing"), [
      ["state", any(s.state), { "data-key": "state" }],
      ["doing", any(s.doing), { "data-key": "doing" }],
      ["coordinator", any(s.coordinator_peer_id), { class: "mono" }],
      ["peer id", any(s.peer_id), { class: "mono" }],
    ]);
    const l = s.lease;
    kv(document.getElementById("lease"), l ? [
      ["lease", any(l.lease_id), { "data-key": "lease_id", class: "mono" }],
      ["work", num(l.prompts) + " prompts × " + num(l.group_size) + " samples at v" + l.policy_version],
      ["deadline", RS.isNum(l.deadline_in_s) ? "in " + duration(l.deadline_in_s) : RS.DASH],
    ] : [["", "no lease in hand"]]);
    kv(document.getElementById("verdicts"), [
      ["leases done", num(s.leases_done), { "data-key": "leases_done" }],
      ["accepted", num(s.leases_accepted) + " leases, " + num(s.samples_accepted) + " samples"],
      ["rejected", num(s.leases_rejected), { "data-key": "leases_rejected" }],
      ["last refusal", s.last_reject ? s.last_reject + (RS.isNum(s.last_reject_age_s) ? " (" + duration(s.last_reject_age_s) + " ago)" : "") : "none",
        { "data-key": "last_reject" }],
      ["coordinator errors", num(s.coordinator_errors)],
    ]);
    kv(document.getElementById("machine"), [
      ["hardware", any(s.hardware), { "data-key": "hardware" }],
      ["backend", any(s.backend), { "data-key": "backend" }],
      ["asking price", s.price_per_hour === null ? "free" : money(s.price_per_hour) + " per hour"],
      ["generating for", duration(s.generate_s)],
      ["software", any(s.software_version)],
    ]);
  }

  function column(rows, key) {
    return rows.map((r) => (RS.isNum(r[key]) ? r[key] : null));
  }

  async function step() {
    const [status, hist] = await Promise.all([getJSON("/status"), getJSON("/api/history?since=" + state.seq)]);
    if (hist.full) state.samples = [];
    state.samples = RS.decimate(state.samples.concat(hist.samples || []), 1800);
    state.seq = hist.seq;
    state.status = status;
    render(status);
    const ts = column(state.samples, "t");
    state.charts.tps.update([ts, column(state.samples, "tokens_per_s")]);
    state.charts.work.update([ts, column(state.samples, "samples_accepted"), column(state.samples, "leases_rejected")]);
    state.renders += 1;
    state.lastOk = Date.now();
    document.body.setAttribute("data-renders", String(state.renders));
    document.body.setAttribute("data-uptime", String(status.uptime_s)); // which snapshot is shown
  }

  function onState(ok) {
    const live = document.getElementById("live");
    live.className = ok ? "live" : "live lost";
    fill(live, ok ? "live · updated " + new Date().toLocaleTimeString()
      : "node unreachable, retrying" + (state.lastOk ? " (last update " + duration((Date.now() - state.lastOk) / 1000) + " ago)" : ""));
  }

  state.charts.tps = new Chart(document.getElementById("chart-tps"), { x: "time", yLabel: "tokens/s",
    series: [{ label: "tokens/s" }] });
  state.charts.work = new Chart(document.getElementById("chart-work"), { x: "time", yLabel: "samples",
    y2Label: "leases", series: [{ label: "accepted samples" }, { label: "rejected leases", scale: "y2", color: "#c92a2a" }] });
  window.addEventListener("resize", () => Object.values(state.charts).forEach((c) => c.resize()));
  RS.poll(step, 2000, onState);
})();
