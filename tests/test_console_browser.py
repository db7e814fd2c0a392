"""End to end in a real headless browser (Debian's chromium through its chromedriver, driven
by Selenium): the console on a free port over a SQLite backend, and over the suite's private
Redis (about 6 s more), each holding a failed run, beside an engine that can resume it; the
runs page, the failed run, a click on retry, the run completed.

Real time (a browser does not follow a virtual clock), bounded: every wait has a deadline.
"""

from __future__ import annotations

import shutil
import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

import durable_trio as dt
from durable_trio.console import serve_console

pytestmark = [pytest.mark.browser, pytest.mark.timeout(90)]

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def _shop(declined: set[str]) -> dt.App:
    app = dt.App("shop")

    @app.step("charge", retry=dt.Retry(max_attempts=1))
    async def charge(order: dict[str, Any]) -> dict[str, Any]:
        if order["id"] in declined:
            raise ValueError(f"card declined for order {order['id']}")
        return {"charged": order["amount"]}

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
        return {"receipt": await ctx.step("charge", order)}

    return app


@pytest.mark.parametrize(
    "kind",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_retry_a_failed_run_in_a_real_browser(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    if kind == "redis":  # the suite's private server, emptied for this test
        url = str(request.getfixturevalue("redis_url"))
    elif kind == "postgres":  # the suite's private server, a fresh schema
        url = str(request.getfixturevalue("postgres_schema_url"))
    else:
        url = "sqlite:///" + str(tmp_path / "console.db")
    declined = {"bad"}
    app = _shop(declined)
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        async with dt.open_backend(url) as backend:
            async with dt.open_worker(app, backend, concurrency=2):
                async with dt.open_engine(app, backend, reconcile_interval=0.5) as engine:
                    await engine.start("order", {"id": "ok", "amount": 1}, run_id="ok")
                    await engine.result("ok")
                    await engine.start("order", {"id": "bad", "amount": 9}, run_id="bad")
                    with pytest.raises(dt.RunFailed):
                        await engine.result("bad")
                    declined.clear()  # the card works now: a retry can complete
                    async with dt.open_operations(backend, namespace="shop") as ops:
                        async with trio.open_nursery() as nursery:
                            base = await nursery.start(
                                partial(serve_console, ops, port=0, allow_actions=True)
                            )
                            state["base"] = base
                            state["cancel"] = nursery.cancel_scope
                            state["token"] = trio.lowlevel.current_trio_token()
                            ready.set()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # reported by the test below
            state["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30), "the console did not start"
    assert "error" not in state, state.get("error")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        wait = WebDriverWait(driver, 20)
        driver.get(state["base"] + "/runs")
        assert "Runs" in driver.title
        driver.find_element(By.CSS_SELECTOR, 'a[href="/runs/bad"]').click()
        wait.until(lambda d: "card declined" in d.page_source)
        driver.find_element(By.CSS_SELECTOR, 'button[data-action="retry"]').click()
        wait.until(lambda d: "reopened" in d.find_element(By.ID, "flash").text)
        # the page polls itself: the engine resumes the run and the page shows it completed
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "h1 .badge-completed"))
    finally:
        driver.quit()
        trio.from_thread.run_sync(state["cancel"].cancel, trio_token=state["token"])
        thread.join(15)
    assert not thread.is_alive()
    assert "error" not in state, state.get("error")


def _order_app(packing: threading.Event) -> dt.App:
    app = dt.App("shop")

    @app.step("pack")
    async def pack(x: Any) -> Any:
        packing.set()
        await trio.sleep(3600)  # cancelled with its run
        return x

    @app.step("unpack")
    async def unpack(x: Any) -> str:
        return "unpacked"

    @app.workflow("order")
    async def order(ctx: dt.WorkflowContext, x: Any) -> Any:
        try:
            return await ctx.step("pack", x)
        except dt.RunCancelled:
            await ctx.step("unpack", x)  # compensation
            raise

    @app.workflow("approval")
    async def approval(ctx: dt.WorkflowContext, x: Any) -> Any:
        return {"asked": x, "answer": await ctx.wait_signal("approve")}

    return app


def test_schedules_start_signal_and_a_cancelled_run_in_a_real_browser(tmp_path: Path) -> None:
    """Over SQLite, beside an engine and a worker: the schedules page and its Pause button;
    a run started through the runs page's form, driven by the engine, then sent the signal it
    waits for through its page's form, completed; and a cancelled run's history, its
    interrupted step and the cancel event."""
    if not (Path(CHROMIUM).exists() and shutil.which(CHROMEDRIVER)):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    url = "sqlite:///" + str(tmp_path / "console.db")
    packing = threading.Event()
    app = _order_app(packing)
    ready = threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        async with dt.open_backend(url) as backend:
            async with dt.open_worker(app, backend, concurrency=2, poll_interval=0.05):
                async with dt.open_engine(
                    app, backend, reconcile_interval=0.5, run_lease=3
                ) as engine:
                    async with dt.open_operations(backend, namespace="shop") as ops:
                        await engine.schedules.add("nightly", "order", cron="0 3 * * *")
                        await engine.start("order", {"sku": "x"}, run_id="cut")
                        with trio.fail_after(20):
                            while not packing.is_set():  # noqa: ASYNC110 (a thread's event)
                                await trio.sleep(0.05)
                            assert await ops.cancel_run("cut", reason="customer changed mind")
                        async with trio.open_nursery() as nursery:
                            base = await nursery.start(
                                partial(serve_console, ops, port=0, allow_actions=True)
                            )
                            state["base"] = base
                            state["cancel"] = nursery.cancel_scope
                            state["token"] = trio.lowlevel.current_trio_token()
                            ready.set()

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # reported by the test below
            state["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(40), "the console did not start"
    assert "error" not in state, state.get("error")
    driver = _driver()
    try:
        wait = WebDriverWait(driver, 20)
        base = state["base"]
        # the schedules page, and a click on Pause
        driver.get(base + "/schedules")
        row = driver.find_element(By.CSS_SELECTOR, 'tr[data-schedule="nightly"]')
        assert "cron 0 3 * * * (UTC)" in row.text
        assert " UTC" in row.find_elements(By.TAG_NAME, "time")[0].text
        row.find_element(By.CSS_SELECTOR, 'button[data-action="pause"]').click()
        wait.until(lambda d: "nightly paused" in d.find_element(By.ID, "flash").text)
        wait.until(
            lambda d: d.find_elements(By.CSS_SELECTOR, 'tr[data-schedule="nightly"] .badge-paused')
        )
        # start a run through the form: stored pending, the engine takes it over
        driver.get(base + "/runs")
        driver.find_element(By.CSS_SELECTOR, 'details[data-key="start"] summary').click()
        form = driver.find_element(By.CSS_SELECTOR, 'form[data-action="start"]')
        form.find_element(By.NAME, "workflow").send_keys("approval")
        form.find_element(By.NAME, "run_id").send_keys("from-form")
        given = form.find_element(By.NAME, "input")
        given.clear()
        given.send_keys('{"amount": 7')  # not JSON: a 400 that says so
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "the input is not JSON" in d.find_element(By.ID, "flash").text)
        given.send_keys("}")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "stored (pending)" in d.find_element(By.ID, "flash").text)
        driver.find_element(By.ID, "flash-link").click()
        wait.until(lambda d: "from-form" in d.title)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "h1 .badge-running"))
        # send it the signal it waits for, through its page's form
        driver.find_element(By.CSS_SELECTOR, 'details[data-key="signal"] summary').click()
        form = driver.find_element(By.CSS_SELECTOR, 'form[data-action="signal"]')
        form.find_element(By.NAME, "name").send_keys("approve")
        payload = form.find_element(By.NAME, "payload")
        payload.clear()
        payload.send_keys('{"by": "ana"}')
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda d: "signal 'approve' #1 sent" in d.find_element(By.ID, "flash").text)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "h1 .badge-completed"))
        assert '"by": "ana"' in driver.find_element(By.TAG_NAME, "main").text
        # the cancelled run: its step interrupted (not running), the cancel an event
        driver.get(base + "/runs/cut")
        assert driver.find_elements(By.CSS_SELECTOR, "h1 .badge-cancelled")
        step = driver.find_element(By.CSS_SELECTOR, "tr.step.interrupted")
        assert "pack" in step.text
        assert "interrupted" in step.text
        assert not driver.find_elements(By.CSS_SELECTOR, "tr.step .badge-running")
        event = driver.find_element(By.CSS_SELECTOR, "tr.cancel-event")
        assert "cancel requested" in event.text
        assert "customer changed mind" in event.text
        assert "interrupting step 1 (pack)" in event.text
        colour = driver.find_element(By.CSS_SELECTOR, "h1 .badge-cancelled").value_of_css_property(
            "background-color"
        )
        assert colour != "rgba(198, 40, 40, 1)"  # not the red of failed
    finally:
        driver.quit()
        trio.from_thread.run_sync(state["cancel"].cancel, trio_token=state["token"])
        thread.join(15)
    assert not thread.is_alive()
    assert "error" not in state, state.get("error")


def _driver() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
