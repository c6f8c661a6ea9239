// The edgegw dashboard: reads /dashboard/feed (one JSON snapshot a second) and draws it.
// Any field of a snapshot may be missing or null: everything here shows "—" for it.
// Text is only ever set with textContent (target names are URLs from the configuration).
"use strict";
(() => {
  const HISTORY_S = 300; // the charts keep the last five minutes
  const MIN_SPAN_S = 30; // and span at least this much, widening as history grows
  const STALE_AFTER = 3; // snapshot intervals without one: the feed is stale (and at least 2 s)
  const SVG = "http://www.w3.org/2000/svg";
  const STAGES = ["admit", "cache", "route", "queue", "pool", "upstream", "engine", "prefill", "first_token", "decode"];
  const BURN_WINDOWS = ["5m", "30m", "1h", "6h"];

  const $ = (id) => document.getElementById(id);
  const isNum = (v) => typeof v === "number" && Number.isFinite(v);
  const fmtRate = (v) => (!isNum(v) ? "—" : v.toFixed(v >= 99.5 ? 0 : v >= 9.995 ? 1 : 2));
  const fmtInt = (v) => (isNum(v) ? String(Math.round(v)) : "—");
  const fmtPct = (v) => (!isNum(v) ? "—" : `${(v * 100).toFixed(v === 0 || v >= 0.995 ? 0 : 1)}%`);
  const fmtMs = (v) =>
    !isNum(v) ? "—" : v >= 999.5 ? `${(v / 1000).toFixed(2)} s` : `${v.toFixed(v >= 99.5 ? 0 : v >= 9.995 ? 1 : 2)} ms`;
  const obj = (v) => (v !== null && typeof v === "object" && !Array.isArray(v) ? v : {});
  const words = (s) => String(s).replace(/_/g, " ");

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text != null) node.textContent = text;
    return node;
  }

  function setText(node, text) {
    if (node.textContent !== text) node.textContent = text;
  }

  function setClass(node, cls) {
    if (node.className !== cls) node.className = cls;
  }

  function stat(dl, label, field) {
    const box = el("div");
    box.append(el("dt", null, label));
    const dd = el("dd", null, "—");
    dd.dataset.field = field;
    box.append(dd);
    dl.append(box);
    return dd;
  }

  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const base = 10 ** Math.floor(Math.log10(v));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * base >= v) return m * base;
    return 10 * base;
  }

  // A small time series: one SVG path per series over the last HISTORY_S seconds.
  class Chart {
    constructor(label, series, format) {
      this.series = series; // [{key, cls, name}]
      this.format = format;
      this.root = el("div", "chart");
      const head = el("div", "chart-head");
      head.append(el("span", "label", label));
      const values = el("span", "values");
      this.values = series.map((s, i) => {
        if (i) values.append(" · ");
        values.append(el("span", `k-${s.cls}`, s.name ? `${s.name} ` : ""));
        const v = el("span", "num", "—");
        v.dataset.field = s.key;
        values.append(v);
        return v;
      });
      head.append(values);
      const box = el("div", "chart-box");
      const svg = document.createElementNS(SVG, "svg");
      svg.setAttribute("viewBox", "0 0 300 60");
      svg.setAttribute("preserveAspectRatio", "none");
      svg.setAttribute("aria-hidden", "true");
      this.paths = series.map((s) => {
        const path = document.createElementNS(SVG, "path");
        path.setAttribute("class", `s-${s.cls}`);
        path.setAttribute("vector-effect", "non-scaling-stroke");
        svg.append(path);
        return path;
      });
      this.ymax = el("span", "ymax");
      this.span = el("span", "span");
      box.append(svg, this.ymax, this.span);
      this.root.append(head, box);
    }

    draw(history, now) {
      const oldest = history.t.length ? history.t[0] : now;
      const span = Math.min(HISTORY_S, Math.max(MIN_SPAN_S, now - oldest));
      setText(this.span, span >= 120 ? `last ${Math.round(span / 60)} min` : `last ${Math.round(span)} s`);
      let top = 0;
      for (const s of this.series) for (const v of history[s.key]) if (isNum(v) && v > top) top = v;
      const max = niceCeil(top);
      setText(this.ymax, top > 0 ? this.format(max) : "");
      this.series.forEach((s, i) => {
        const column = history[s.key];
        let d = "";
        let pen = false;
        for (let j = 0; j < column.length; j++) {
          const v = column[j];
          if (!isNum(v)) {
            pen = false;
            continue;
          }
          const x = 300 - ((now - history.t[j]) / span) * 300;
          const y = 58 - (v / max) * 56;
          d += `${pen ? "L" : "M"}${x.toFixed(1)} ${y.toFixed(1)}`;
          pen = true;
        }
        this.paths[i].setAttribute("d", d || "M0 0");
        setText(this.values[i], this.format(column.length ? column[column.length - 1] : null));
      });
    }
  }

  // One target (an endpoint or the edge engine): its state, numbers, charts and stages.
  class Card {
    constructor(name) {
      this.history = { t: [], rps: [], ttft50: [], ttft99: [], itl50: [], itl99: [] };
      const root = (this.root = el("article", "card"));
      root.dataset.target = name;
      const head = el("div", "card-head");
      head.append(el("h3", null, name));
      this.breaker = el("span", "badge");
      head.append(this.breaker);
      const meta = el("div", "meta");
      this.kind = el("span", "chip");
      this.cluster = el("span", "chip");
      meta.append(this.kind, this.cluster);
      this.diagnosis = el("div", "diagnosis");
      this.verdict = el("span", "badge");
      this.evidence = el("span", "evidence");
      this.diagnosis.append(this.verdict, this.evidence);
      const stats = el("dl", "stats");
      this.rps = stat(stats, "req/s", "rps");
      this.waiting = stat(stats, "waiting", "waiting");
      this.active = stat(stats, "active", "active");
      this.active.title = "requests sent to it / the gateway's limit for it";
      this.service = stat(stats, "served/s", "service");
      this.errors = stat(stats, "errors", "errors");
      const charts = el("div", "charts");
      this.charts = [
        new Chart("requests/s", [{ key: "rps", cls: "rps", name: "" }], fmtRate),
        new Chart("TTFT", [{ key: "ttft50", cls: "p50", name: "p50" }, { key: "ttft99", cls: "p99", name: "p99" }], fmtMs),
        new Chart("inter-token", [{ key: "itl50", cls: "p50", name: "p50" }, { key: "itl99", cls: "p99", name: "p99" }], fmtMs),
      ];
      for (const chart of this.charts) charts.append(chart.root);
      const stages = el("div", "stages");
      stages.append(el("div", "label", "where the time goes (p50 per stage)"));
      this.bar = el("div", "bar");
      this.legend = el("div", "legend");
      stages.append(this.bar, this.legend);
      root.append(head, meta, this.diagnosis, stats, charts, stages);
    }

    update(t, now) {
      setText(this.kind, t.kind ? String(t.kind) : "target");
      this.cluster.hidden = !t.cluster;
      setText(this.cluster, t.cluster ? `cluster ${t.cluster}` : "");
      const breaker = typeof t.breaker === "string" ? t.breaker : null;
      this.breaker.hidden = breaker === null;
      setClass(this.breaker, `badge breaker breaker-${breaker}`);
      setText(this.breaker, breaker ? words(breaker) : "");
      this.breaker.title = "circuit breaker";
      const diagnosis = obj(t.diagnosis);
      const verdict = typeof diagnosis.verdict === "string" ? diagnosis.verdict : "unknown";
      setClass(this.diagnosis, `diagnosis verdict-${verdict}`);
      setText(this.verdict, words(verdict));
      setText(this.evidence, diagnosis.evidence ? String(diagnosis.evidence) : verdict === "unknown" ? "no diagnosis yet" : "");

      const queue = obj(t.queue);
      setText(this.rps, fmtRate(t.requests_per_s));
      setText(this.waiting, fmtInt(queue.waiting));
      const limit = isNum(queue.limit) ? fmtInt(queue.limit) : "∞"; // no limit at the gateway
      setText(this.active, isNum(queue.active) ? `${fmtInt(queue.active)}/${limit}` : "—");
      setText(this.service, fmtRate(queue.service_rate_per_s));
      setText(this.errors, fmtPct(t.error_rate));

      const h = this.history;
      const ttft = obj(t.ttft_ms);
      const itl = obj(t.itl_ms);
      const point = { t: now, rps: t.requests_per_s, ttft50: ttft.p50, ttft99: ttft.p99, itl50: itl.p50, itl99: itl.p99 };
      for (const key in h) h[key].push(point[key]);
      while (h.t.length && h.t[0] < now - HISTORY_S) for (const key in h) h[key].shift();
      for (const chart of this.charts) chart.draw(h, now);
      this.drawStages(obj(t.stages_ms));
    }

    drawStages(stages) {
      const names = [...STAGES.filter((s) => s in stages), ...Object.keys(stages).filter((s) => !STAGES.includes(s))];
      const parts = names.map((name) => [name, obj(stages[name]).p50]).filter(([, v]) => isNum(v) && v >= 0);
      const total = parts.reduce((sum, [, v]) => sum + v, 0);
      this.bar.replaceChildren();
      this.legend.replaceChildren();
      if (!parts.length) {
        this.legend.append("no stage timings yet");
        return;
      }
      for (const [name, v] of parts) {
        const cls = `st-${STAGES.includes(name) ? name : "other"}`;
        if (total > 0 && v > 0) {
          const segment = el("span", cls);
          segment.style.flexGrow = String(v / total);
          segment.title = `${name} ${fmtMs(v)}`;
          this.bar.append(segment);
        }
        const key = el("span");
        key.append(el("i", cls), `${name} ${fmtMs(v)}`);
        this.legend.append(key);
      }
    }
  }

  const cards = new Map();

  function renderGateway(g) {
    setText($("gw-rps"), fmtRate(g.requests_per_s));
    setText($("gw-inflight"), fmtInt(g.in_flight));
    setText($("gw-cache"), fmtPct(g.cache_hit_rate));
    const shedding = $("gw-shedding");
    setText(shedding, g.shedding === true ? "yes" : g.shedding === false ? "no" : "—");
    shedding.style.color = g.shedding === true ? "var(--bad)" : "";
  }

  function renderTargets(targets, now) {
    const box = $("targets");
    const seen = new Set();
    let i = 0;
    for (const t of targets) {
      if (t === null || typeof t !== "object" || typeof t.name !== "string" || seen.has(t.name)) continue;
      seen.add(t.name);
      let card = cards.get(t.name);
      if (!card) cards.set(t.name, (card = new Card(t.name)));
      card.update(t, now);
      if (box.children[i] !== card.root) box.insertBefore(card.root, box.children[i] || null);
      i++;
    }
    for (const [name, card] of cards) {
      if (!seen.has(name)) {
        card.root.remove();
        cards.delete(name);
      }
    }
    if (!seen.size) box.replaceChildren(el("p", "empty", "no targets configured"));
    else for (const node of [...box.children]) if (!node.classList.contains("card")) node.remove();
  }

  function renderSlo(slos) {
    const box = $("slo");
    const rows = slos.filter((s) => s !== null && typeof s === "object");
    if (!rows.length) {
      box.replaceChildren(el("p", "empty", "no SLOs reported"));
      return;
    }
    const items = rows.map((s) => {
      const item = el("div", "slo-item");
      item.dataset.slo = String(s.name ?? "");
      const head = el("div", "slo-head");
      head.append(el("strong", null, String(s.name ?? "—")));
      const what = [s.metric, isNum(s.target) ? fmtPct(s.target) : null].filter((x) => x != null);
      if (what.length) head.append(el("span", "chip", what.join(" · ")));
      const alert = s.alert === true ? ["alert-on", "alert"] : s.alert === false ? ["alert-off", "ok"] : null;
      if (alert) head.append(el("span", `badge ${alert[0]}`, alert[1]));
      const burn = obj(s.burn);
      const windows = [...BURN_WINDOWS, ...Object.keys(burn).filter((w) => !BURN_WINDOWS.includes(w))];
      const grid = el("dl", "burns");
      for (const w of windows) {
        const v = burn[w];
        const dd = stat(grid, `burn ${w}`, `burn-${w}`);
        dd.textContent = isNum(v) ? `${v.toFixed(2)}×` : "—";
        if (isNum(v) && v >= 1) dd.className = v >= 2 ? "burn-high" : "burn-warn";
      }
      stat(grid, "budget left", "budget").textContent = fmtPct(s.error_budget_remaining);
      item.append(head, grid);
      return item;
    });
    box.replaceChildren(...items);
  }

  function renderEngine(engine) {
    const box = $("engine");
    if (engine === null || typeof engine !== "object") {
      box.replaceChildren(el("p", "empty", "no edge engine in this gateway"));
      return;
    }
    const grid = el("dl", "engine-grid");
    stat(grid, "waiting", "engine-waiting").textContent = fmtInt(engine.waiting);
    stat(grid, "running", "engine-running").textContent = fmtInt(engine.running);
    stat(grid, "prefix cache hits", "engine-prefix").textContent = fmtPct(engine.prefix_cache_hit_rate);
    const used = engine.kv_blocks_used;
    const total = engine.kv_blocks_total;
    const share = isNum(used) && isNum(total) && total > 0 ? used / total : null;
    const kv = el("div", "stages kv");
    kv.append(el("div", "label", `KV cache: ${fmtInt(used)} / ${fmtInt(total)} blocks (${fmtPct(share)})`));
    const bar = el("div", "bar");
    if (share !== null) {
      const fill = el("span");
      fill.style.width = `${Math.min(100, share * 100)}%`;
      bar.append(fill);
    }
    kv.append(bar);
    box.replaceChildren(grid, kv);
  }

  function render(snapshot) {
    const s = obj(snapshot);
    const now = isNum(s.time) ? s.time : Date.now() / 1000;
    renderGateway(obj(s.gateway));
    renderTargets(Array.isArray(s.targets) ? s.targets : [], now);
    renderSlo(Array.isArray(s.slo) ? s.slo : []);
    renderEngine(s.engine);
  }

  // The feed. EventSource reconnects by itself after a dropped connection; after a refusal
  // (a 503 while the gateway drains) it gives up, so this starts a new one, backing off.
  let lastAt = 0;
  let interval = 1000; // between snapshots, as measured (ms)
  let backoff = 1000;

  function setFeed(state, text) {
    const feed = $("feed");
    setClass(feed, `feed feed-${state}`);
    setText(feed, text);
  }

  function connect() {
    const source = new EventSource("dashboard/feed");
    source.onopen = () => {
      backoff = 1000;
      setFeed("live", "live");
    };
    source.onmessage = (event) => {
      let snapshot;
      try {
        snapshot = JSON.parse(event.data);
      } catch (err) {
        return; // not a snapshot: keep the last one (the feed turns stale if this goes on)
      }
      const at = Date.now();
      if (lastAt) interval += 0.2 * (Math.min(at - lastAt, 10000) - interval);
      lastAt = at;
      document.body.classList.remove("stale");
      setFeed("live", "live");
      render(snapshot);
    };
    source.onerror = () => {
      setFeed("down", "reconnecting…");
      if (source.readyState === EventSource.CLOSED) {
        source.close();
        setTimeout(connect, backoff);
        backoff = Math.min(backoff * 2, 30000);
      }
    };
  }

  setInterval(() => {
    if (!lastAt) return;
    const age = (Date.now() - lastAt) / 1000;
    setText($("updated"), age < 1.5 ? "just now" : `${Math.round(age)} s ago`);
    if (age > Math.max(2, (STALE_AFTER * interval) / 1000)) {
      document.body.classList.add("stale");
      setFeed("stale", `stale · ${Math.round(age)} s`);
    }
  }, 500);

  connect();
})();
