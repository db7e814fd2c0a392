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

  function flash(text, ok) {
    let el = document.getElementById("flash");
    if (!el) {
      el = document.createElement("div");
      el.id = "flash";
      el.setAttribute("role", "status");
      document.body.insertBefore(el, document.getElementById("main"));
    }
    el.textContent = text;
    el.className = ok ? "flash ok" : "flash error";
  }

  function editing() {
    const active = document.activeElement;
    return active && active.closest && active.closest("#main form") !== null;
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
      if (fresh && main && !editing()) main.innerHTML = fresh.innerHTML;
      if (doc.body && doc.body.dataset.live) document.body.dataset.live = doc.body.dataset.live;
      interval = BASE_INTERVAL;
      setState("live", true);
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

  async function act(button) {
    const question = button.getAttribute("data-confirm");
    if (question && !window.confirm(question)) return;
    button.disabled = true;
    try {
      const reply = await fetch(button.getAttribute("data-url"), {
        method: "POST",
        headers: {
          "X-Durable-Console": "action",
          "Content-Type": "application/json",
        },
        credentials: "same-origin",
        body: button.getAttribute("data-body") || "{}",
      });
      let message = "HTTP " + reply.status;
      try {
        const data = await reply.json();
        if (data && data.message) message = data.message;
      } catch (err) {
        /* not JSON: the status says it */
      }
      flash(message, reply.ok);
    } catch (err) {
      flash("the console did not answer: " + err, false);
    } finally {
      button.disabled = false;
      await refresh();
      if (timer === null) schedule();
    }
  }

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
