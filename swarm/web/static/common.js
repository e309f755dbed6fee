// rollout-swarm pages: helpers shared by the dashboard and the node page (no framework).
//
// Security rule of these pages: data never becomes markup. Every value a node controls (its GPU
// names, its software string, error details) reaches the DOM through textContent or a text node;
// attributes are set one by one from a short allow-list; there is no innerHTML anywhere. The server
// also sends a Content-Security-Policy that allows no inline script.
"use strict";

const RS = (() => {
  const DASH = "\u2013"; // shown for a missing value, never "undefined" or "NaN"

  /** An element with allow-listed attributes and text or element children. */
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined) continue;
      if (key === "class") node.className = String(value);
      else if (key === "title") node.title = String(value);
      else if (key.startsWith("data-")) node.setAttribute(key, String(value));
      else if (key === "href" && /^\/[a-z/]*$/.test(String(value))) node.setAttribute("href", value);
      else throw new Error("attribute not allowed: " + key);
    }
    for (const child of children) append(node, child);
    return node;
  }

  function append(node, child) {
    if (child === null || child === undefined || child === false) return;
    if (Array.isArray(child)) child.forEach((c) => append(node, c));
    else if (child instanceof Node) node.appendChild(child);
    else node.appendChild(document.createTextNode(String(child)));
  }

  /** Replace the children of ``node`` with ``children``. */
  function fill(node, ...children) {
    node.replaceChildren();
    for (const child of children) append(node, child);
    return node;
  }

  function isNum(v) {
    return typeof v === "number" && Number.isFinite(v);
  }

  function grouped(value, decimals) {
    return value.toLocaleString("en-US", {
      minimumFractionDigits: decimals,
      maximumFractionDigits: decimals,
    });
  }

  /** Like swarm.display.fmt_number: 3 significant figures, whole numbers from 100 up. */
  function num(v, digits = 3) {
    if (v === null || v === undefined) return DASH;
    if (typeof v === "boolean") return v ? "yes" : "no";
    if (typeof v !== "number") return String(v);
    if (!Number.isFinite(v)) return DASH;
    // JSON does not tell 1.0 from 1: whole numbers show as integers (Python shows "1.00")
    if (Number.isInteger(v) || Math.abs(v) >= Math.pow(10, digits - 1)) return grouped(v, 0);
    const decimals = Math.max(0, digits - 1 - Math.floor(Math.log10(Math.abs(v))));
    return grouped(v, decimals);
  }

  function pct(v) {
    return isNum(v) ? num(v * 100) + " %" : DASH;
  }

  function rate(v, unit) {
    const text = num(v);
    return text === DASH ? DASH : text + " " + unit;
  }

  function money(v) {
    if (v === null || v === undefined) return "free";
    return isNum(v) ? "$" + v.toFixed(2) : DASH;
  }

  /** Like swarm.display.fmt_duration: 42s, 3m05s, 2h10m. */
  function duration(seconds) {
    if (!isNum(seconds)) return DASH;
    const s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m" + String(s % 60).padStart(2, "0") + "s";
    return Math.floor(s / 3600) + "h" + String(Math.floor((s % 3600) / 60)).padStart(2, "0") + "m";
  }

  /** Any JSON value as one line of text (maps as "k v · k v", lists comma-separated). */
  function any(v, shortKeys) {
    if (v === null || v === undefined) return DASH;
    if (Array.isArray(v)) {
      return v.length ? v.map((x) => (shortKeys && shortKeys[x]) || any(x, shortKeys)).join(", ") : "none";
    }
    if (typeof v === "object") {
      const items = Object.entries(v);
      if (!items.length) return "none";
      return items.map(([k, x]) => ((shortKeys && shortKeys[k]) || k) + ": " + any(x)).join(" · ");
    }
    return num(v);
  }

  /** Shortest prefix (at least 6 characters) of each fingerprint's body that stays unique. */
  function shortIds(fingerprints, minLen = 6) {
    const body = (fp) => String(fp).replace(/^ed25519:/, "");
    const distinct = Array.from(new Set(fingerprints.map(body))).sort();
    const need = {};
    for (let i = 0; i + 1 < distinct.length; i++) {
      const a = distinct[i], b = distinct[i + 1];
      let common = 0;
      while (common < Math.min(a.length, b.length) && a[common] === b[common]) common++;
      need[a] = Math.max(need[a] || 0, common + 1);
      need[b] = Math.max(need[b] || 0, common + 1);
    }
    const out = {};
    for (const fp of fingerprints) {
      const b = body(fp);
      out[fp] = b.slice(0, Math.max(minLen, need[b] || 0));
    }
    return out;
  }

  /** GET a JSON document, failing after ``timeoutMs``. */
  async function getJSON(url, timeoutMs = 5000) {
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), timeoutMs);
    try {
      const resp = await fetch(url, { signal: ctl.signal, cache: "no-store" });
      if (!resp.ok) throw new Error(url + ": HTTP " + resp.status);
      return await resp.json();
    } finally {
      clearTimeout(timer);
    }
  }

  /** Keep at most ``cap`` rows: drop every second row of the older half (as the server does). */
  function decimate(rows, cap) {
    if (rows.length <= cap) return rows;
    const half = Math.floor(rows.length / 2);
    return rows.slice(0, half).filter((_, i) => i % 2 === 0).concat(rows.slice(half));
  }

  /** Run ``step`` now and then every ``periodMs`` after it settles; ``onState(ok, error)``. */
  function poll(step, periodMs, onState) {
    async function run() {
      try {
        await step();
        onState(true, null);
      } catch (err) {
        onState(false, err);
      }
      setTimeout(run, periodMs);
    }
    run();
  }

  /** Time-axis labels on one line, 24-hour local time (seconds only when ticks are < 1 min). */
  function clockLabels(u, splits, axisIdx, space, incr) {
    const opts = incr >= 60 ? { hour: "2-digit", minute: "2-digit", hour12: false } : { hour12: false };
    return splits.map((t) => new Date(t * 1000).toLocaleTimeString("en-GB", opts));
  }

  /** Tick steps of an axis that counts things (no 2.5 submissions). */
  const COUNT_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 1e6];

  /** On a log axis, label and grid only the powers of ten. */
  function decadesOnly(u, splits) {
    return splits.map((v) => (v > 0 && Math.abs(Math.log10(v) - Math.round(Math.log10(v))) < 1e-9 ? v : null));
  }

  const PALETTE = ["#2f6fde", "#e8590c", "#1a7f4b", "#9c36b5", "#c92a2a", "#0b7285", "#5c940d",
    "#e67700", "#495057", "#d6336c"];

  /**
   * A uPlot line (or bar) chart that follows its container's width.
   * spec: {x: "time" | "number", xLabel, series: [{label, scale?, color?, bars?}],
   *        scales: {y: {range}, y2: {...}}, yLabel, y2Label}
   */
  class Chart {
    constructor(container, spec) {
      this.container = container;
      this.spec = spec;
      this.plot = null;
      this.data = null;
      this.labels = null;
    }

    options() {
      const s = this.spec;
      const logScale = ((s.scales || {}).y || {}).distr === 3;
      const scales = { x: { time: s.x === "time" } };
      for (const [name, scale] of Object.entries(s.scales || {})) scales[name] = scale;
      // options left out, not set to undefined: uPlot would take undefined over its defaults
      const xAxis = { stroke: "#667085", grid: { stroke: "#eef0f3" }, ticks: { stroke: "#e3e6eb" },
        label: s.xLabel, labelSize: s.xLabel ? 18 : 0, labelFont: "12px system-ui",
        space: s.x === "time" ? 50 : 40 };
      if (s.x === "time") xAxis.values = clockLabels;
      else xAxis.incrs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000];
      const yAxis = { scale: "y", stroke: "#667085", grid: { stroke: "#eef0f3" },
        ticks: { stroke: "#e3e6eb" }, label: s.yLabel, labelSize: s.yLabel ? 18 : 0,
        labelFont: "12px system-ui", size: 64 };
      if (s.counts) yAxis.incrs = COUNT_INCRS;
      if (logScale) {
        yAxis.filter = decadesOnly;
        yAxis.grid.filter = decadesOnly;
        yAxis.ticks.filter = decadesOnly;
      }
      const axes = [xAxis, yAxis];
      if (s.series.some((x) => x.scale === "y2")) {
        axes.push({ scale: "y2", side: 1, stroke: "#667085", grid: { show: false },
          label: s.y2Label, labelSize: s.y2Label ? 18 : 0, labelFont: "12px system-ui", size: 56 });
      }
      const series = [{ label: s.xLabel || (s.x === "time" ? "time" : "x") }].concat(
        s.series.map((x, i) => {
          const color = x.color || PALETTE[i % PALETTE.length];
          const out = { label: x.label, scale: x.scale || "y", stroke: color, width: 2,
            spanGaps: true, points: { show: false } };
          if (x.dash) out.dash = [6, 4];
          if (x.bars) {
            out.paths = uPlot.paths.bars({ size: [0.6, 80] });
            out.fill = color + "99";
            out.points = { show: false };
          }
          return out;
        }),
      );
      return {
        width: Math.max(260, this.container.clientWidth),
        height: 210,
        scales,
        axes,
        series,
        legend: { live: false },
        cursor: { drag: { x: true, y: false } },
      };
    }

    /** data: [xs, ys1, ys2, ...]; the series labels may change (the chart is then rebuilt). */
    update(data, labels) {
      this.data = data;
      const key = JSON.stringify(labels || null);
      if (labels && key !== this.labels) {
        this.spec.series = labels.map((l, i) => Object.assign({}, this.spec.series[i] || {}, l));
        if (this.plot) this.plot.destroy();
        this.plot = null;
      }
      this.labels = key;
      if (!this.plot) {
        this.container.replaceChildren();
        this.plot = new uPlot(this.options(), data, this.container);
      } else {
        this.plot.setData(data);
      }
    }

    resize() {
      if (this.plot) this.plot.setSize({ width: Math.max(260, this.container.clientWidth), height: 210 });
    }

    /** Points drawn (tests wait for curves). */
    points() {
      return this.data && this.data[0] ? this.data[0].length : 0;
    }
  }

  function kv(dl, entries) {
    fill(dl);
    for (const [label, value, attrs] of entries) {
      dl.appendChild(el("dt", null, label));
      dl.appendChild(el("dd", attrs || null, value));
    }
  }

  return { DASH, el, fill, num, pct, rate, money, duration, any, shortIds, getJSON, decimate,
    poll, Chart, kv, isNum };
})();
