// durable_trio console: bounded polling of the page shown, and the action buttons.
// No framework, no build step: the server renders every page; this script only refreshes
// <main> from the same address and posts actions. Only a live page (data-live="1") is polled:
// a page that is not (an ended run's) is fetched again only after an action, and polling
// starts or stops as the fetched page says (a retried run is live again until it ends).
"use strict";

(function () {
  const BASE_INTERVAL = 3000; // ms between refreshes while the page is visible
  const MAX_INTERVAL = 30000; // the back-off's ceiling after failed refreshes
  let interval = BASE_INTERVAL;
  let inFlight = false;
  let timer = null;

  function setState(text, ok) {
    const el = document.getElementById("live-state");
    if (el) {
      el.textContent = text;
      el.className = ok ? "" : "offline";
    }
  }

  function flash(text, ok, location) {
    let el = document.getElementById("flash");
    if (!el) {
      el = document.createElement("div");
      el.id = "flash";
      el.setAttribute("role", "status");
      document.body.insertBefore(el, document.getElementById("main"));
    }
    el.textContent = text; // text, never markup: a message may quote what was typed
    el.className = ok ? "flash ok" : "flash error";
    if (location) {
      const link = document.createElement("a");
      link.href = location;
      link.textContent = "open it";
      link.id = "flash-link";
      el.append(" · ", link);
    }
  }

  function editing() {
    const active = document.activeElement;
    if (active && active.closest && active.closest("#main form") !== null) return true;
    // a form typed into and not sent yet: the page holds still until it is sent
    return document.querySelector("#main form[data-dirty]") !== null;
  }

  function openKeys(root) {
    const keys = new Set();
    root.querySelectorAll("details[open][data-key]").forEach(function (el) {
      keys.add(el.dataset.key);
    });
    return keys;
  }

  function reopen(root, keys) {
    root.querySelectorAll("details[data-key]").forEach(function (el) {
      if (keys.has(el.dataset.key)) el.open = true;
    });
  }

  async function refresh() {
    if (inFlight) return;
    inFlight = true;
    try {
      const reply = await fetch(window.location.href, {
        headers: { "X-Durable-Console": "poll" },
        credentials: "same-origin",
        cache: "no-store",
      });
      if (!reply.ok) throw new Error("HTTP " + reply.status);
      const doc = new DOMParser().parseFromString(await reply.text(), "text/html");
      const fresh = doc.getElementById("main");
      const main = document.getElementById("main");
      const held = editing();
      if (fresh && main && !held) {
        const keys = openKeys(main); // what the reader unfolded stays unfolded
        main.innerHTML = fresh.innerHTML;
        reopen(main, keys);
      }
      if (doc.body && doc.body.dataset.live) document.body.dataset.live = doc.body.dataset.live;
      interval = BASE_INTERVAL;
      setState(held ? "held while you edit" : "live", true);
    } catch (err) {
      interval = Math.min(interval * 2, MAX_INTERVAL);
      setState("offline, retrying", false);
    } finally {
      inFlight = false;
    }
  }

  function live() {
    return document.body.dataset.live === "1";
  }

  function schedule() {
    if (timer !== null) clearTimeout(timer);
    timer = null;
    if (!live()) return; // not polled: an action's refresh may make it live again
    timer = setTimeout(async function () {
      timer = null;
      if (document.visibilityState === "visible" && live()) await refresh();
      schedule();
    }, interval);
  }

  // POST body (JSON text) to url as an action; flash what the console answers. Returns
  // whether it succeeded.
  async function post(url, body) {
    try {
      const reply = await fetch(url, {
        method: "POST",
        headers: {
          "X-Durable-Console": "action",
          "Content-Type": "application/json",
        },
        credentials: "same-origin",
        body: body,
      });
      let message = "HTTP " + reply.status;
      let location = null;
      try {
        const data = await reply.json();
        if (data && data.message) message = data.message;
        if (data && typeof data.location === "string" && data.location.startsWith("/")) {
          location = data.location;
        }
      } catch (err) {
        /* not JSON: the status says it */
      }
      flash(message, reply.ok, location);
      return reply.ok;
    } catch (err) {
      flash("the console did not answer: " + err, false, null);
      return false;
    }
  }

  async function act(button) {
    const question = button.getAttribute("data-confirm");
    if (question && !window.confirm(question)) return;
    button.disabled = true;
    try {
      await post(button.getAttribute("data-url"), button.getAttribute("data-body") || "{}");
    } finally {
      button.disabled = false;
      await refresh();
      if (timer === null) schedule();
    }
  }

  async function submit(form) {
    const fields = {};
    new FormData(form).forEach(function (value, key) {
      fields[key] = String(value);
    });
    const button = form.querySelector("button[type=submit]");
    if (button) button.disabled = true;
    try {
      if (await post(form.getAttribute("data-url"), JSON.stringify(fields))) {
        delete form.dataset.dirty; // sent: the page may refresh again
      }
    } finally {
      if (button) button.disabled = false;
      if (document.activeElement && form.contains(document.activeElement)) {
        document.activeElement.blur();
      }
      if (!form.dataset.dirty) await refresh();
      if (timer === null) schedule();
    }
  }

  document.addEventListener("submit", function (event) {
    const form = event.target.closest && event.target.closest("form[data-url]");
    if (form) {
      event.preventDefault();
      submit(form);
    }
  });

  document.addEventListener("input", function (event) {
    const form = event.target.closest && event.target.closest("form[data-url]");
    if (form) form.dataset.dirty = "1";
  });

  document.addEventListener("click", function (event) {
    const button = event.target.closest && event.target.closest("button[data-action]");
    if (button && !button.disabled) {
      event.preventDefault();
      act(button);
    }
  });

  document.addEventListener("visibilitychange", function () {
    if (document.visibilityState === "visible" && live()) {
      refresh();
    }
  });

  schedule();
})();
