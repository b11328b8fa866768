// tokenmill's dashboard: polls /admin/dashboard/data (tokenmill/server/dashboard.py documents the
// JSON), turns counter deltas between polls into rates, keeps the series of this session and
// draws them with uPlot; tables and bars show the rest. Sections whose data is empty stay hidden.
// ?interval_ms=N polls every N ms (default 2000).
"use strict";

(function () {
  const DATA_URL = "/admin/dashboard/data";
  const KEY_STORAGE = "tokenmill.dashboard.key";
  const INTERVAL_MS = Math.max(200, Number(new URLSearchParams(location.search).get("interval_ms")) || 2000);
  const HISTORY = 1800;  // points kept per chart: an hour at the default interval
  const RATE_WINDOW_S = 10;  // rates are counter deltas over about this long (tokens count when a request ends)
  const COUNTERS = {generated: "generation_tokens", prompt: "prompt_tokens", requests: "requests"};
  const QUANTILES = ["p50", "p90", "p99"];
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777", "#4b5563"];

  // ---- formatting: what the page shows (the tests read the same strings) ----
  const DASH = "–";
  const int = (v) => (v == null ? DASH : String(Math.round(v)));
  const fixed = (digits) => (v) => (v == null ? DASH : v.toFixed(digits));
  const ms = fixed(2);        // the JSON's milliseconds already have 2 decimals
  const rate = fixed(1);
  const money = fixed(4);
  const pct = (v) => (v == null ? DASH : (100 * v).toFixed(1) + "%");

  // ---- DOM helpers (text only: no markup from the data) ----
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }
  const section = (name) => document.querySelector(`[data-section="${name}"]`);
  const cell = (field, text) => el("td", {"data-field": field}, text);

  function bar(share) {  // a bar filled to share (0-1); empty when unknown
    const fill = el("div", {class: "fill"});
    fill.style.width = `${Math.max(0, Math.min(1, share || 0)) * 100}%`;
    if (share != null && share > 1) fill.classList.add("over");
    return el("div", {class: "bar"}, fill);
  }

  function fillRows(tbody, rows) {  // rows: [key, [td, ...]]
    tbody.replaceChildren(...rows.map(([key, cells]) => el("tr", {"data-key": key}, ...cells)));
  }

  function show(name, visible) {
    section(name).hidden = !visible;
    return visible;
  }

  // ---- series kept in the browser, drawn with uPlot ----
  class Chart {
    constructor(id, title, unit) {
      this.container = document.getElementById(id);
      this.title = title;
      this.unit = unit;
      this.times = [];
      this.lines = new Map();  // label -> values, aligned with times (null: no value)
      this.plot = null;
      this.drawn = "";
    }

    push(time, values) {  // values: {label: number|null}; a line starts at its first value
      for (const [label, value] of Object.entries(values)) {
        if (!this.lines.has(label) && value != null) this.lines.set(label, this.times.map(() => null));
      }
      this.times.push(time);
      for (const [label, line] of this.lines) line.push(values[label] ?? null);
      if (this.times.length > HISTORY) {
        this.times.shift();
        for (const line of this.lines.values()) line.shift();
      }
      this.draw();
    }

    draw() {
      const labels = [...this.lines.keys()];
      if (!labels.length) return;
      const data = [this.times, ...labels.map((label) => this.lines.get(label))];
      const key = labels.join("\n");
      if (this.plot && key === this.drawn) {
        this.plot.setData(data);
        return;
      }
      if (this.plot) this.plot.destroy();
      this.drawn = key;
      this.plot = new uPlot(this.options(labels), data, this.container);
    }

    options(labels) {
      return {
        title: this.title, width: this.width(), height: 200, legend: {live: false},
        scales: {x: {time: true}, y: {range: (u, min, max) => [0, max > 0 ? max * 1.1 : 1]}},
        axes: [{}, {label: this.unit, size: 56}],
        series: [{}, ...labels.map((label, i) => ({label, stroke: COLORS[i % COLORS.length], width: 1.5}))],
      };
    }

    width() {
      return Math.max(240, this.container.clientWidth - 8);
    }

    resize() {
      if (this.plot) this.plot.setSize({width: this.width(), height: 200});
    }
  }

  const charts = {
    tokens: new Chart("chart-tokens", `Generated tokens/s (${RATE_WINDOW_S} s window)`, "tok/s"),
    requests: new Chart("chart-requests", `Finished requests/s (${RATE_WINDOW_S} s window)`, "req/s"),
    queue: new Chart("chart-queue", "Requests running and waiting", "requests"),
    kv: new Chart("chart-kv", "KV cache in use", "%"),
    ttft: new Chart("chart-ttft", "Time to first token, since start", "ms"),
    tpot: new Chart("chart-tpot", "Time per output token, since start", "ms"),
    e2e: new Chart("chart-e2e", "End-to-end latency, since start", "ms"),
  };
  window.addEventListener("resize", () => Object.values(charts).forEach((chart) => chart.resize()));
  const state = {counters: [], polls: 0, timer: null, charts};
  window.tokenmillDashboard = state;  // for the browser test and the console

  // ---- rates: counter deltas between this poll and the newest one at least RATE_WINDOW_S older ----
  function rates(data) {
    const history = state.counters;
    history.push({time: data.time, models: data.models});
    while (history.length > 2 && data.time - history[1].time >= RATE_WINDOW_S) history.shift();
    const then = history[0];
    const seconds = data.time - then.time;
    const out = {};
    for (const [model, now] of Object.entries(data.models)) {
      const before = then.models[model];
      out[model] = {};
      for (const [name, field] of Object.entries(COUNTERS)) {  // a counter with no sample yet is at 0
        const delta = before && seconds > 0 ? (now[field] ?? 0) - (before[field] ?? 0) : -1;
        out[model][name] = delta >= 0 ? delta / seconds : null;  // < 0: unknown, or the server restarted
      }
    }
    return out;
  }

  function pushCharts(data, perSecond) {
    const t = data.time;
    const byModel = (f) => Object.fromEntries(Object.entries(data.models).map(([m, entry]) => [m, f(entry, m)]));
    charts.tokens.push(t, byModel((e, m) => perSecond[m].generated));
    charts.requests.push(t, byModel((e, m) => perSecond[m].requests));
    const queue = {};
    for (const [m, e] of Object.entries(data.models)) {
      queue[`${m} running`] = e.running;
      queue[`${m} waiting`] = e.waiting;
    }
    charts.queue.push(t, queue);
    charts.kv.push(t, byModel((e) => (e.kv_cache_usage == null ? null : 100 * e.kv_cache_usage)));
    for (const kind of ["ttft", "tpot", "e2e"]) {
      const points = {};
      for (const [m, e] of Object.entries(data.models)) {
        for (const q of QUANTILES) points[`${m} ${q}`] = e.latency[kind][`${q}_ms`];
      }
      charts[kind].push(t, points);
    }
  }

  // ---- tables ----
  function renderModels(data, perSecond) {
    const rows = Object.entries(data.models).map(([m, e]) => [m, [
      el("th", {"data-field": "model"}, m), cell("requests", int(e.requests)),
      cell("prompt_tokens", int(e.prompt_tokens)), cell("generation_tokens", int(e.generation_tokens)),
      cell("generated_per_s", rate(perSecond[m].generated)), cell("prompt_per_s", rate(perSecond[m].prompt)),
      cell("requests_per_s", fixed(2)(perSecond[m].requests)),
      cell("running", int(e.running)), cell("waiting", int(e.waiting)), cell("kv_cache_usage", pct(e.kv_cache_usage)),
      cell("prefix_cache_hit_rate", pct(e.prefix_cache_hit_rate)), cell("preemptions", int(e.preemptions)),
      cell("rejected", int(Object.values(e.rejected).reduce((a, b) => a + b, 0))),
      cell("cold_start_seconds", fixed(2)(e.cold_start_seconds)),
    ]]);
    fillRows(section("models").querySelector("tbody"), rows);
    document.getElementById("models-served").textContent = Object.keys(data.models).join(", ");
  }

  function renderLatency(data) {
    const names = {ttft: "time to first token", tpot: "time per output token", e2e: "end to end", queue: "queue"};
    const rows = [];
    for (const [m, e] of Object.entries(data.models)) {
      for (const [kind, figures] of Object.entries(e.latency)) {
        if (!figures.count) continue;
        rows.push([`${m}/${kind}`, [el("th", {"data-field": "model"}, m), cell("latency", names[kind] || kind),
          cell("count", int(figures.count)), cell("mean_ms", ms(figures.mean_ms)),
          ...QUANTILES.map((q) => cell(`${q}_ms`, ms(figures[`${q}_ms`])))]]);
      }
    }
    if (show("latency", rows.length > 0)) fillRows(section("latency").querySelector("tbody"), rows);
  }

  function renderTenants(data) {
    const fields = ["requests", "prompt_tokens", "cached_tokens", "completion_tokens"];
    const rows = Object.entries(data.tenants).map(([t, usage]) =>
      [t, [el("th", {"data-field": "tenant"}, t), ...fields.map((f) => cell(f, int(usage[f])))]]);
    if (show("tenants", rows.length > 0)) fillRows(section("tenants").querySelector("tbody"), rows);
  }

  function barList(container, values) {  // {name: value} as labelled bars scaled to the largest
    const top = Math.max(0, ...Object.values(values));
    container.replaceChildren(...Object.entries(values).sort((a, b) => b[1] - a[1]).map(([name, value]) =>
      el("div", {class: "bar-row", "data-key": name}, el("span", {class: "label"}, name),
        bar(top > 0 ? value / top : 0), el("span", {class: "value", "data-field": "cost"}, money(value)))));
  }

  function labelText(labels) {
    const parts = Object.entries(labels).map(([k, v]) => `${k}=${v}`);
    return parts.length ? parts.join(", ") : "all";
  }

  function renderCost(data) {
    const cost = data.cost;
    if (!show("cost", cost != null)) return;
    const totals = [["request", "Charged to requests"], ["metered", "Metered"], ["idle", "Idle"], ["other", "Other"]]
      .filter(([field]) => cost[field] != null)
      .map(([field, name]) => el("div", {class: "total"}, el("span", {class: "label"}, name),
        el("span", {class: "value", "data-field": field}, money(cost[field]))));
    document.getElementById("cost-totals").replaceChildren(...totals);
    barList(document.getElementById("cost-models"), cost.by_model);
    barList(document.getElementById("cost-tenants"), cost.by_tenant);
    fillRows(document.querySelector("#cost-pairs tbody"), cost.by_tenant_model.map((p) =>
      [`${p.tenant}/${p.model_name}`, [el("th", {"data-field": "tenant"}, p.tenant),
        cell("model_name", p.model_name), cell("cost", money(p.cost))]]));
    const other = [];
    for (const [field, name] of [["metered_by", "Metered"], ["idle_by", "Idle"], ["other_by", "Other"]]) {
      if (!cost[field].some((s) => Object.keys(s.labels).length)) continue;  // one unlabelled total: shown above
      other.push(el("h3", {}, `${name}, by label`), el("ul", {}, ...cost[field].map((s) =>
        el("li", {}, `${labelText(s.labels)}: ${money(s.value)}`))));
    }
    document.getElementById("cost-other").replaceChildren(...other);
  }

  function renderPrices(data) {
    const models = Object.entries(data.models).filter(([, e]) => Object.keys(e.cost_per_1k_tokens).length);
    if (!show("prices", models.length > 0)) return;
    const kinds = [...new Set(models.flatMap(([, e]) => Object.keys(e.cost_per_1k_tokens)))];
    const order = ["prompt", "cached", "completion"];
    kinds.sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99) || a.localeCompare(b));
    const table = section("prices").querySelector("table");
    table.tHead.replaceChildren(el("tr", {}, el("th", {}, "Model"), ...kinds.map((k) => el("th", {}, k))));
    fillRows(table.tBodies[0], models.map(([m, e]) => [m, [el("th", {"data-field": "model"}, m),
      ...kinds.map((k) => cell(k, fixed(6)(e.cost_per_1k_tokens[k])))]]));
  }

  function renderSlo(data) {
    const rows = Object.entries(data.slo).map(([t, s]) => [t, [el("th", {"data-field": "tenant"}, t),
      cell("met", int(s.met)), cell("missed", int(s.missed)),
      el("td", {"data-field": "compliance"}, bar(s.compliance), pct(s.compliance))]]);
    if (show("slo", rows.length > 0)) fillRows(section("slo").querySelector("tbody"), rows);
  }

  function renderBudgets(data) {
    const rows = Object.entries(data.budgets).map(([t, b]) => [t, [el("th", {"data-field": "tenant"}, t),
      cell("spent", money(b.spent)), cell("held", money(b.held)), cell("limit", b.limit ? money(b.limit) : "none"),
      el("td", {"data-field": "share"}, bar(b.share), pct(b.share)), cell("overrun", money(b.overrun)),
      cell("soft_limit_alerts", int(b.soft_limit_alerts))]]);
    if (show("budgets", rows.length > 0)) fillRows(section("budgets").querySelector("tbody"), rows);
  }

  function renderRouting(data) {
    const routes = Object.entries(data.routing);
    if (!show("routing", routes.length > 0)) return;
    const models = [...new Set(routes.flatMap(([, r]) => Object.keys(r.by_model)))].sort();
    const table = section("routing").querySelector("table");
    table.tHead.replaceChildren(el("tr", {}, el("th", {}, "Route"), el("th", {}, "Requests"),
      ...models.map((m) => el("th", {}, `→ ${m}`)), el("th", {}, "Escalations"), el("th", {}, "Escalation rate")));
    fillRows(table.tBodies[0], routes.map(([route, r]) => [route, [el("th", {"data-field": "route"}, route),
      cell("requests", int(r.requests)), ...models.map((m) => cell(`model:${m}`, int(r.by_model[m] ?? 0))),
      cell("escalations", int(r.escalations)),
      el("td", {"data-field": "escalation_rate"}, bar(r.escalation_rate), pct(r.escalation_rate))]]));
  }

  function renderSpeculation(data) {
    const models = Object.entries(data.models).filter(([, e]) => e.speculation);
    if (!show("speculation", models.length > 0)) return;
    fillRows(section("speculation").querySelector("tbody"), models.map(([m, e]) => {
      const s = e.speculation;
      const positions = el("div", {class: "positions"}, ...s.accepted_per_position.map((kept, j) =>
        el("div", {class: "position", title: `position ${j}: ${pct(kept / s.drafts)}`}, bar(kept / s.drafts))));
      return [m, [el("th", {"data-field": "model"}, m), cell("drafts", int(s.drafts)),
        cell("draft_tokens", int(s.draft_tokens)), cell("accepted_tokens", int(s.accepted_tokens)),
        el("td", {"data-field": "acceptance_rate"}, bar(s.acceptance_rate), pct(s.acceptance_rate)),
        cell("mean_accepted_length", fixed(2)(s.mean_accepted_length)), el("td", {"data-field": "positions"}, positions)]];
    }));
  }

  function render(data) {
    const perSecond = rates(data);
    document.getElementById("auth").hidden = true;
    document.getElementById("content").hidden = false;
    renderModels(data, perSecond);
    renderLatency(data);
    renderTenants(data);
    renderCost(data);
    renderPrices(data);
    renderSlo(data);
    renderBudgets(data);
    renderRouting(data);
    renderSpeculation(data);
    pushCharts(data, perSecond);
    state.polls += 1;
    setStatus(`updated ${new Date(data.time * 1000).toLocaleTimeString()} · every ${INTERVAL_MS / 1000} s`);
  }

  // ---- polling and the admin key ----
  function setStatus(text) {
    document.getElementById("status").textContent = text;
  }

  function askForKey(status, message) {
    const hasKey = sessionStorage.getItem(KEY_STORAGE) != null;
    const why = status === 403
      ? "This key is not an admin key: the dashboard needs the key of an admin tenant."
      : hasKey ? "This key was not accepted: the dashboard needs the key of an admin tenant."
        : "Admin key needed: this server has API keys configured; enter the key of an admin tenant.";
    document.getElementById("auth-message").textContent = `${why} (server: ${message})`;
    document.getElementById("auth").hidden = false;
    document.getElementById("content").hidden = true;
    document.getElementById("auth").dataset.status = String(status);
    setStatus(`HTTP ${status}`);
  }

  async function poll() {
    clearTimeout(state.timer);
    const key = sessionStorage.getItem(KEY_STORAGE);
    const headers = key ? {authorization: `Bearer ${key}`} : {};
    let response;
    try {
      response = await fetch(DATA_URL, {headers, cache: "no-store"});
    } catch (error) {
      setStatus(`the server does not answer (${error.message}); retrying`);
      state.timer = setTimeout(poll, INTERVAL_MS);
      return;
    }
    const body = await response.json().catch(() => null);
    if (response.status === 401 || response.status === 403) {
      askForKey(response.status, (body && body.error && body.error.message) || response.statusText);
      return;  // polling resumes when a key is entered
    }
    if (response.ok && body) {
      render(body);
    } else {
      setStatus(`HTTP ${response.status}: ${(body && body.error && body.error.message) || response.statusText}; retrying`);
    }
    state.timer = setTimeout(poll, INTERVAL_MS);
  }

  document.getElementById("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = document.getElementById("auth-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    document.getElementById("auth-key").value = "";
    poll();
  });
  document.getElementById("auth-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORAGE);
    poll();
  });
  poll();
})();
