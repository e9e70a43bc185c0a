// The overview's live refresh: every 5 s, the figures from /ui/api/overview go into the cells that
// name them (data-field). Text only (textContent), never markup: every value may be hostile.
"use strict";

(function () {
  const root = document.querySelector("[data-live]");
  if (!root) return;
  const url = root.getAttribute("data-live");

  function pick(data, path) {
    return path.split(".").reduce((v, k) => (v == null ? v : v[k]), data);
  }

  function format(value, fmt) {
    if (value == null) return "\u2014";
    const digits = /%\.(\d)f/.exec(fmt || "");
    if (digits) return Number(value).toFixed(Number(digits[1]));
    return String(Math.round(Number(value)));
  }

  function cell(row, value, header) {
    const c = document.createElement(header ? "th" : "td");
    if (header) c.setAttribute("scope", "row");
    if (value && typeof value === "object") {  // {text, href}: a link within the console
      const a = document.createElement("a");
      a.href = value.href;
      a.textContent = String(value.text);
      c.appendChild(a);
    } else {
      c.textContent = value == null ? "" : String(value);
    }
    row.appendChild(c);
  }

  function replicas(backends) {
    const body = document.querySelector("#replicas tbody");
    if (!body) return;
    body.replaceChildren();
    for (const [name, b] of Object.entries(backends)) {
      if (!b.replicas.length) {
        const row = body.insertRow();
        cell(row, name, true);
        const c = document.createElement("td");
        c.colSpan = 7;
        c.textContent = (b.available ? "available" : "unavailable: " + (b.reason || "")) + " (hosted)";
        row.appendChild(c);
        continue;
      }
      for (const r of b.replicas) {
        const row = body.insertRow();
        cell(row, name, true);
        for (const v of [r.url, r.check_ok ? "ok" : "failing", r.breaker, r.in_flight, r.queue_depth, r.kv_usage, r.last_error || ""]) {
          cell(row, v, false);
        }
      }
    }
  }

  function rows(selector, items, columns, empty) {
    const body = document.querySelector(selector + " tbody");
    if (!body) return;
    body.replaceChildren();
    if (!items.length) {
      const c = body.insertRow().insertCell();
      c.colSpan = columns(null).length;
      c.textContent = empty;
      return;
    }
    for (const item of items) {
      const row = body.insertRow();
      columns(item).forEach((v, i) => cell(row, v, i === 0 && selector === "#backend-use"));
    }
  }

  async function refresh() {
    try {
      const answer = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (answer.status === 401) {
        window.location.assign("/ui/login?next=/ui");
        return;
      }
      if (!answer.ok) return;
      const data = await answer.json();
      for (const el of document.querySelectorAll("[data-field]")) {
        const path = el.getAttribute("data-field");
        el.textContent = path === "at" ? String(data.at) : format(pick(data, path), el.getAttribute("data-format"));
      }
      replicas(data.backends);
      rows("#backend-use", data.day.backends, (b) => (b ? [b.backend, b.requests, b.prompt_tokens, b.completion_tokens, b.cost_usd] : [1, 2, 3, 4, 5]), "No requests in the last day.");
      rows("#failovers", data.failovers, (f) => (f ? [{ text: f.at, href: "/ui/requests/" + encodeURIComponent(f.id) }, f.model, f.backend, f.status, f.failover] : [1, 2, 3, 4, 5]), "None.");
    } catch (err) {
      // the gateway restarting: the next tick tries again
    }
  }

  window.setInterval(refresh, 5000);
})();
