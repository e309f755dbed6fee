// The coordinator's dashboard: polls /status and /api/history every 2 s and redraws in place.
//
// Fields are shown generically where they are not known by name: any node_* map of /status becomes
// a column of the node table, every trainer_* figure a line of the learner panel, every plan_*
// figure a line of the capacity panel, and anything else a line of "everything else". A field
// that is missing shows as "–". Values are text only (see common.js).
//
// A large swarm's /status carries node counts only (node_maps_omitted): the table is then read a
// page at a time from /api/nodes?offset=&limit= (the coordinator builds only that page).
"use strict";

(() => {
  const { el, fill, num, pct, rate, money, duration, any, shortIds, getJSON, decimate, Chart, kv } = RS;
  const PERIOD_MS = 2000;
  const MAX_STEPS = 4000;
  const MAX_TICKS = 3600;
  const NODE_PAGE = 100; // nodes per page of /api/nodes

  const state = {
    status: null,
    epoch: null,
    seq: null,
    steps: [],
    ticks: [],
    staleness: {},
    renders: 0,
    nodeOffset: 0, // first node of the page shown (paged table only)
    lastOk: null,
    charts: {},
  };
  window.RSDash = state; // for tests and for poking around in the console

  // --- the node table --------------------------------------------------------------------------
  const STATE_ORDER = { active: 0, standby: 1, banned: 2, gone: 3 };
  // known node_* maps: [key, column title, cell class, formatter(value, status, fp)]
  const NODE_COLUMNS = [
    ["node_hardware", "hardware", "wrap", (v) => any(v)],
    ["node_backend", "backend", "", (v) => any(v)],
    ["node_tokens_per_s", "tok/s", "num", (v) => num(v)],
    ["node_rollouts_per_s", "rollouts/s", "num", (v) => num(v)],
    ["node_price_per_hour", "price/h", "num", (v) => money(v)],
    ["node_trust", "trust", "num", (v) => num(v)],
    ["node_verification_rate", "verified", "num", (v) => pct(v)],
  ];
  const NODE_TAIL = [
    ["node_versions_held", "versions held", "nowrap", (v) => (Array.isArray(v) && v.length ? v.map((x) => "v" + x).join(" ") : any(v))],
    ["node_leases_completed", "leases done", "num", (v) => num(v)],
    ["node_last_seen_s", "last seen", "num", (v) => (RS.isNum(v) ? duration(v) + " ago" : RS.DASH)],
  ];
  // shown inside other cells (state, last error, node id) rather than as columns
  const NODE_FOLDED = new Set(["node_states", "node_counts", "node_suspect", "node_strikes", "node_ban_reason",
    "node_banned_for_s", "node_last_error", "node_last_error_age_s", "node_peer_id", "node_software"]);

  function nodeMaps(status) {
    const maps = {};
    for (const [key, value] of Object.entries(status)) {
      if (key.startsWith("node_") && value && typeof value === "object" && !Array.isArray(value)) {
        maps[key] = value;
      }
    }
    return maps;
  }

  function stateCell(status, fp) {
    const get = (k) => (status[k] || {})[fp];
    const st = get("node_states") || "unknown";
    const parts = [el("span", { class: "badge " + (STATE_ORDER[st] !== undefined ? st : "unknown"), "data-state": st }, st)];
    if (get("node_suspect") && st !== "banned") {
      const strikes = get("node_strikes");
      parts.push(" ", el("span", { class: "badge suspect" }, "suspect"));
      if (RS.isNum(strikes) && strikes > 0) parts.push(el("span", { class: "reason" }, strikes + (strikes === 1 ? " strike" : " strikes")));
    }
    const reason = get("node_ban_reason");
    if (st === "banned" || reason) {
      const left = get("node_banned_for_s");
      parts.push(el("span", { class: "reason" },
        (reason || "reason not reported") + (RS.isNum(left) ? " · " + duration(left) + " left" : "")));
    }
    return el("td", { "data-col": "state" }, parts);
  }

  function renderNodes(status) {
    const table = document.getElementById("nodes");
    const states = status.node_states || {};
    const maps = nodeMaps(status);
    const fps = Array.from(new Set(Object.values(maps).flatMap((m) => Object.keys(m))))
      .filter((fp) => fp.startsWith("ed25519:"));
    fps.sort((a, b) => ((STATE_ORDER[states[a]] ?? 9) - (STATE_ORDER[states[b]] ?? 9)) || (a < b ? -1 : 1));
    const known = new Set([...NODE_COLUMNS, ...NODE_TAIL].map((c) => c[0]));
    const extras = Object.keys(maps).filter((k) => !known.has(k) && !NODE_FOLDED.has(k)).sort()
      .map((k) => [k, k.replace(/^node_/, "").replace(/_/g, " "), "", (v) => any(v)]);
    // optional known columns appear once the coordinator reports them
    const columns = [...NODE_COLUMNS.filter((c) => maps[c[0]] || !["node_trust", "node_verification_rate"].includes(c[0])),
      ...extras];
    const ids = shortIds(fps);
    fill(table.tHead, el("tr", null,
      el("th", null, "node"),
      columns.map((c) => el("th", { class: c[2] === "num" ? "num" : "" }, c[1])),
      el("th", null, "state"),
      NODE_TAIL.map((c) => el("th", { class: c[2] === "num" ? "num" : "" }, c[1])),
      el("th", null, "last error")));
    const cell = (c, fp) => {
      const m = maps[c[0]];
      const v = m ? m[fp] : undefined;
      return el("td", { class: c[2], "data-col": c[0] }, c[3](v, status, fp));
    };
    const rows = fps.map((fp) => {
      const peer = (maps.node_peer_id || {})[fp];
      const software = (maps.node_software || {})[fp];
      const err = (maps.node_last_error || {})[fp];
      const errAge = (maps.node_last_error_age_s || {})[fp];
      return el("tr", { "data-fp": fp },
        el("td", { class: "mono", "data-col": "node", title: fp + (peer ? "\npeer " + peer : "") + (software ? "\n" + software : "") }, ids[fp]),
        columns.map((c) => cell(c, fp)),
        stateCell(status, fp),
        NODE_TAIL.map((c) => cell(c, fp)),
        el("td", { class: err ? "err" : "", "data-col": "node_last_error" },
          err ? [err, el("span", { class: "reason" }, RS.isNum(errAge) ? duration(errAge) + " ago" : "")] : RS.DASH));
    });
    fill(table.tBodies[0], rows);
    document.getElementById("nodes-empty").hidden = fps.length > 0;
    const counts = nodeCounts(status);
    const total = RS.isNum(status.node_maps_omitted) ? status.node_maps_omitted : fps.length;
    fill(document.getElementById("nodes-hint"),
      `${total} registered · ${counts.active || 0} active · ${counts.standby || 0} standby · ${counts.banned || 0} banned · ${counts.gone || 0} gone`);
    const paged = RS.isNum(status.node_maps_omitted);
    document.getElementById("nodes-pager").hidden = !paged;
    if (paged) {
      const last = Math.min(total, state.nodeOffset + fps.length);
      fill(document.getElementById("nodes-page"), `nodes ${state.nodeOffset + 1}–${last} of ${total} (by fingerprint)`);
      document.getElementById("nodes-prev").disabled = state.nodeOffset <= 0;
      document.getElementById("nodes-next").disabled = last >= total;
    }
  }

  // nodes by state: the coordinator's counts (always there), else counted from node_states
  function nodeCounts(status) {
    if (status.node_counts && typeof status.node_counts === "object") return status.node_counts;
    const out = {};
    for (const st of Object.values(status.node_states || {})) out[st] = (out[st] || 0) + 1;
    return out;
  }

  function pageNodes(delta) {
    state.nodeOffset = Math.max(0, state.nodeOffset + delta * NODE_PAGE);
    if (state.status) step().catch(() => {});
  }
  document.getElementById("nodes-prev").addEventListener("click", () => pageNodes(-1));
  document.getElementById("nodes-next").addEventListener("click", () => pageNodes(1));

  // --- headline figures ------------------------------------------------------------------------
  function lastTick() {
    return state.ticks.length ? state.ticks[state.ticks.length - 1] : {};
  }

  function renderKpis(s) {
    const rejected = Object.values(s.rejected_by_reason || {}).reduce((a, b) => a + (RS.isNum(b) ? b : 0), 0);
    const topReason = Object.entries(s.rejected_by_reason || {}).sort((a, b) => b[1] - a[1])[0];
    const counts = nodeCounts(s);
    const holders = (s.version_holders || {})[String(s.policy_version)];
    const cards = [
      ["learner step", "trainer_step", num(s.trainer_step), s.trainer_step_time_s !== undefined ? num(s.trainer_step_time_s) + " s a step" : ""],
      ["policy version", "policy_version", num(s.policy_version), holders !== undefined ? "held by " + num(holders) + " nodes" : ""],
      ["exact match", "trainer_exact_match", num(s.trainer_exact_match), "last step"],
      ["mean reward", "trainer_reward_mean", num(s.trainer_reward_mean), "last step"],
      ["held-out accuracy", "trainer_eval_greedy_acc", num(s.trainer_eval_greedy_acc),
        RS.isNum(s.trainer_eval_version) ? "greedy, v" + s.trainer_eval_version + " · base " + num(s.trainer_eval_base_greedy_acc)
          : "not evaluated"],
      ["learner idle", "trainer_idle_frac", pct(s.trainer_idle_frac), "of wall time, waiting for rollouts"],
      ["intake", "intake_per_s", rate(lastTick().intake_per_s, "/s"), "accepted rollouts, last 10 s"],
      ["rollouts accepted", "rollouts_accepted", num(s.rollouts_accepted), "queue " + num(s.queue_depth)],
      ["nodes active", "nodes_active", num(counts.active || 0),
        num(s.nodes_alive) + " alive · " + num(s.nodes_registered) + " registered"],
      ["submissions rejected", "rejected_total", num(rejected), topReason ? "mostly " + topReason[0] : "none"],
    ];
    fill(document.getElementById("kpis"), cards.map(([label, key, value, sub]) =>
      el("div", { class: "kpi" },
        el("div", { class: "label" }, label),
        el("div", { class: "value", "data-key": key }, value),
        el("div", { class: "sub", title: sub }, sub))));
  }

  // --- panels ----------------------------------------------------------------------------------
  const SHOWN = new Set(["coordinator_fingerprint", "peer_id", "uptime_s", "status_seq", "policy_version", "rollouts_accepted",
    "queue_depth", "nodes_alive", "nodes_registered", "rejected_by_reason", "version_holders",
    "version_holders_age_s", "versions", "versions_held", "versions_loaded", "plan"]);

  const VERIFICATION = /^(verify_|verifier_|verification_|admission_|leases_in_verification$|leases_held_for_verification$)/;
  function isVerification(key) { return VERIFICATION.test(key); }

  function renderPanels(s) {
    const ids = shortIds(Object.keys(s.node_states || {}));
    const planEntries = [["plan", s.plan === undefined ? RS.DASH : any(s.plan)]];
    for (const [k, v] of Object.entries(s).sort()) {
      if (k.startsWith("plan_")) planEntries.push([k.replace(/^plan_/, "").replace(/_/g, " "), any(v, ids), { "data-key": k }]);
    }
    kv(document.getElementById("plan"), planEntries);

    const holders = s.version_holders || {};
    const age = s.version_holders_age_s;
    kv(document.getElementById("versions"), [
      ["current", s.policy_version === null || s.policy_version === undefined ? RS.DASH : "v" + s.policy_version],
      ["usable (within S)", any(s.versions)],
      ["nodes holding", Object.keys(holders).length
        ? Object.entries(holders).sort((a, b) => Number(b[0]) - Number(a[0])).map(([v, n]) => "v" + v + ": " + num(n)).join(" · ")
          + (RS.isNum(age) ? " (counted " + duration(age) + " ago)" : "")
        : RS.DASH],
      ["held by the coordinator", any(s.versions_held)],
      ["loaded for spot checks", any(s.versions_loaded)],
    ]);

    const learner = Object.entries(s).filter(([k]) => k.startsWith("trainer_")).sort()
      .map(([k, v]) => [k.replace(/^trainer_/, "").replace(/_/g, " "), any(v), { "data-key": k }]);
    kv(document.getElementById("learner"), learner.length ? learner : [["", "no report from the learner yet"]]);

    // the verification budget (V, D, admission), the re-scores' cost and the verifier processes
    const verification = Object.entries(s).filter(([k]) => isVerification(k)).sort()
      .map(([k, v]) => [k.replace(/_/g, " "), any(v), { "data-key": k }]);
    kv(document.getElementById("verification"),
      verification.length ? verification : [["", "no figure of the verification budget yet"]]);

    const other = Object.entries(s)
      .filter(([k]) => !SHOWN.has(k) && !k.startsWith("trainer_") && !k.startsWith("plan_") && !k.startsWith("node_")
        && !isVerification(k))
      .sort().map(([k, v]) => [k.replace(/_/g, " "), any(v, ids), { "data-key": k }]);
    kv(document.getElementById("other"), other);

    fill(document.getElementById("coord"), shortIds([s.coordinator_fingerprint || "–"])[s.coordinator_fingerprint || "–"] || RS.DASH);
    document.getElementById("coord").title = (s.coordinator_fingerprint || "") + "\npeer " + (s.peer_id || "");
    fill(document.getElementById("uptime"), duration(s.uptime_s));
  }

  // --- charts ----------------------------------------------------------------------------------
  function column(rows, key) {
    return rows.map((r) => (RS.isNum(r[key]) ? r[key] : null));
  }

  function makeCharts() {
    const c = (id, spec) => (state.charts[id] = new Chart(document.getElementById("chart-" + id), spec));
    c("reward", { x: "number", xLabel: "learner step", scales: { y: { range: [0, 1] } },
      series: [{ label: "mean reward" }, { label: "exact match" }] });
    c("staleness", { x: "number", xLabel: "staleness (versions behind)", yLabel: "rollouts",
      scales: { x: { time: false, range: (u, lo, hi) => [lo - 0.5, hi + 0.5] },
        y: { range: (u, lo, hi) => [0, Math.max(1, hi) * 1.1] } },
      series: [{ label: "rollouts trained", bars: true, color: "#2f6fde" }] });
    c("quality", { x: "number", xLabel: "learner step", y2Label: "KL",
      scales: { y: { range: [0, 1] } },
      series: [{ label: "ESS fraction" }, { label: "mismatch KL", scale: "y2", color: "#e8590c" }] });
    c("idle", { x: "number", xLabel: "learner step", y2Label: "versions",
      scales: { y: { range: [0, 1] } },
      series: [{ label: "learner idle fraction" }, { label: "mean staleness", scale: "y2", color: "#9c36b5" }] });
    c("stability", { x: "number", xLabel: "learner step", y2Label: "grad norm",
      scales: { y: { range: [0, 1] } },
      series: [{ label: "clip fraction" }, { label: "mask fraction", color: "#e67700" },
        { label: "gradient norm", scale: "y2", color: "#495057" }] });
    // the factor is 1 while target_step_kl is off; the step KL is measured only when
    // target_step_kl or max_step_kl is set (null otherwise: no line)
    c("step", { x: "number", xLabel: "learner step", yLabel: "× lr", y2Label: "nats/token",
      scales: { y: { range: (u, lo, hi) => [0, Math.max(1, hi) * 1.05] } },
      series: [{ label: "learning-rate factor" }, { label: "step KL", scale: "y2", color: "#d6336c" }] });
    // the held-out evaluation (trainer/evaluation.py): its curve comes whole with /status
    c("heldout", { x: "number", xLabel: "policy version", scales: { y: { range: [0, 1] } },
      series: [{ label: "greedy accuracy", color: "#1a7f4b" },
        { label: "95% interval", color: "#1a7f4b", dash: true },
        { label: "95% interval (upper)", color: "#1a7f4b", dash: true },
        { label: "pass@1", color: "#2f6fde" }] });
    c("holders", { x: "time", yLabel: "nodes", counts: true, series: [] });
    c("intake", { x: "time", yLabel: "rollouts/s", y2Label: "queue",
      series: [{ label: "accepted rollouts/s" }, { label: "queue depth", scale: "y2", color: "#868e96", dash: true }] });
    c("rejections", { x: "time", yLabel: "submissions", counts: true, series: [] });
    // log scale: near the pole of the rule (T_bcast close to κ·T_train) "required" jumps by orders
    // of magnitude, which would flatten "available" on a linear axis
    c("capacity", { x: "time", yLabel: "rollouts/s (log)", scales: { y: { distr: 3 } },
      series: [{ label: "required" }, { label: "available", color: "#1a7f4b" }] });
    window.addEventListener("resize", () => Object.values(state.charts).forEach((ch) => ch.resize()));
  }

  function renderHeldout(s) {
    const list = (key) => (Array.isArray(s[key]) ? s[key].map((v) => (RS.isNum(v) ? v : null)) : []);
    const vs = list("trainer_eval_curve_version");
    state.charts.heldout.update([vs, list("trainer_eval_curve_greedy"), list("trainer_eval_curve_greedy_lo"),
      list("trainer_eval_curve_greedy_hi"), list("trainer_eval_curve_pass1")]);
  }

  function renderCharts() {
    if (state.status) renderHeldout(state.status);
    const steps = state.steps;
    const xs = column(steps, "step");
    const ch = state.charts;
    ch.reward.update([xs, column(steps, "reward_mean"), column(steps, "exact_match")]);
    ch.quality.update([xs, column(steps, "ess_frac"), column(steps, "mismatch_kl")]);
    ch.idle.update([xs, column(steps, "idle_frac"), column(steps, "staleness_mean")]);
    ch.stability.update([xs, column(steps, "clip_frac"), column(steps, "mask_frac"), column(steps, "grad_norm")]);
    ch.step.update([xs, column(steps, "lr_factor"), column(steps, "step_kl")]);
    const hist = Object.entries(state.staleness).filter(([k]) => /^-?\d+$/.test(k)).map(([k, v]) => [Number(k), v]).sort((a, b) => a[0] - b[0]);
    ch.staleness.update([hist.map((h) => h[0]), hist.map((h) => h[1])]);

    const ticks = state.ticks;
    const ts = column(ticks, "t");
    ch.intake.update([ts, column(ticks, "intake_per_s"), column(ticks, "queue_depth")]);
    const positive = (key) => column(ticks, key).map((v) => (v !== null && v > 0 ? v : null));
    ch.capacity.update([ts, positive("plan_required_rollouts_per_s"), positive("plan_available_rollouts_per_s")]);

    // holders by age: the newest version counted, the one before, ... (each new version climbs
    // from 0 as it spreads, so the newest line is a sawtooth with one tooth per publication)
    let depth = 1;
    for (const r of ticks) if (r.holders) depth = Math.max(depth, Object.keys(r.holders).length);
    depth = Math.min(depth, 6);
    const newest = (r) => Math.max(...Object.keys(r.holders).map(Number));
    const holderSeries = [];
    for (let k = 0; k < depth; k++) {
      holderSeries.push(ticks.map((r) => {
        if (!r.holders || !Object.keys(r.holders).length) return null;
        const n = r.holders[String(newest(r) - k)];
        return RS.isNum(n) ? n : null;
      }));
    }
    ch.holders.update([ts, ...holderSeries],
      holderSeries.map((_, k) => ({ label: k === 0 ? "newest version" : "newest − " + k })));

    const reasons = Array.from(new Set(ticks.flatMap((r) => Object.keys(r.rejected || {})))).sort();
    const rejSeries = reasons.map((reason) => ticks.map((r) => {
      const v = (r.rejected || {})[reason];
      return RS.isNum(v) ? v : 0;
    }));
    ch.rejections.update([ts, ...(reasons.length ? rejSeries : [ts.map(() => 0)])],
      (reasons.length ? reasons : ["none yet"]).map((r) => ({ label: r })));
  }

  // --- the loop --------------------------------------------------------------------------------
  function mergeHistory(h) {
    if (h.full || h.epoch !== state.epoch) {
      state.steps = [];
      state.ticks = [];
    }
    state.epoch = h.epoch;
    state.seq = h.seq;
    state.steps = decimate(state.steps.concat(h.steps || []), MAX_STEPS);
    state.ticks = decimate(state.ticks.concat(h.ticks || []), MAX_TICKS);
    state.staleness = h.staleness_hist || {};
  }

  async function step() {
    const since = state.seq === null ? "" : "?since=" + state.seq + "&epoch=" + encodeURIComponent(state.epoch);
    const [status, hist] = await Promise.all([getJSON("/status"), getJSON("/api/history" + since)]);
    state.status = status;
    mergeHistory(hist);
    renderKpis(status);
    if (RS.isNum(status.node_maps_omitted)) {
      const page = await getJSON(`/api/nodes?offset=${state.nodeOffset}&limit=${NODE_PAGE}`);
      const { total, offset, limit, ...maps } = page;
      renderNodes({ ...status, ...maps });
    } else {
      renderNodes(status);
    }
    renderPanels(status);
    renderCharts();
    state.renders += 1;
    state.lastOk = Date.now();
    document.body.setAttribute("data-renders", String(state.renders));
    document.body.setAttribute("data-uptime", String(status.uptime_s));
    document.body.setAttribute("data-snapshot", String(status.status_seq)); // which snapshot is shown
  }

  function onState(ok, err) {
    const live = document.getElementById("live");
    if (ok) {
      live.className = "live";
      fill(live, "live · updated " + new Date().toLocaleTimeString());
    } else {
      live.className = "live lost";
      const since = state.lastOk ? " (last update " + duration((Date.now() - state.lastOk) / 1000) + " ago)" : "";
      fill(live, "coordinator unreachable, retrying" + since);
      if (err && window.console) console.warn("dashboard update failed:", err);
    }
  }

  makeCharts();
  RS.poll(step, PERIOD_MS, onState);
})();
