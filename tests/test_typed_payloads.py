"""Typed payloads (issue 34, item 4): a step's or workflow's input and output as the types its
annotations name (attrs classes, dataclasses, datetimes, enums, UUIDs, Decimals, collections),
JSON on the wire and in the store; exact virtual times on every run store
(tests/_every_store.py)."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import uuid
from contextlib import AsyncExitStack
from typing import Any

import attrs
import pytest
import trio
import trio.testing

import durable_trio as dt
from _every_store import open_store
from durable_trio._engine import App, WorkflowContext, open_engine, open_worker
from durable_trio._engine._payloads import (
    PLAIN,
    PayloadTypeError,
    signature_of,
    structure_as,
    to_json,
    unstructure_as,
)


class Size(enum.Enum):
    SMALL = "s"
    LARGE = "l"


@attrs.frozen
class Customer:
    id: uuid.UUID
    since: datetime.date


@dataclasses.dataclass(frozen=True)
class Order:
    customer: Customer
    items: tuple[str, ...]
    sizes: frozenset[Size]
    placed: datetime.datetime
    total: decimal.Decimal


@attrs.frozen
class Quote:
    order_total: decimal.Decimal
    ship_by: datetime.datetime
    sizes: list[Size]


@dataclasses.dataclass(frozen=True)
class Receipt:
    customer: uuid.UUID
    quotes: list[Quote]
    shipped: dict[str, datetime.date]


CUSTOMER = Customer(uuid.UUID("12345678-1234-5678-1234-567812345678"), datetime.date(2024, 2, 29))
ORDER = Order(
    CUSTOMER,
    ("pen", "ink"),
    frozenset({Size.SMALL}),
    datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
    decimal.Decimal("10.10"),
)
QUOTE = Quote(
    decimal.Decimal("10.10"), datetime.datetime(2026, 1, 3, tzinfo=datetime.UTC), [Size.SMALL]
)
ORDER_JSON = {
    "customer": {"id": "12345678-1234-5678-1234-567812345678", "since": "2024-02-29"},
    "items": ["pen", "ink"],
    "sizes": ["s"],
    "placed": "2026-01-02T03:04:05+00:00",
    "total": "10.10",
}
QUOTE_JSON = {"order_total": "10.10", "ship_by": "2026-01-03T00:00:00+00:00", "sizes": ["s"]}


def shop(seen: list[Any]) -> App:
    app = App("typed-shop")

    @app.step("quote", retry=dt.Retry(max_attempts=5))
    async def quote(order: Order) -> Quote:
        seen.append(("quote", order))
        await trio.sleep(2)
        return Quote(
            order.total,
            order.placed + datetime.timedelta(hours=20, minutes=55, seconds=55),
            sorted(order.sizes, key=lambda s: s.value),
        )

    @app.step("raw")
    async def raw(value):  # type: ignore[no-untyped-def]  # unannotated: plain JSON
        seen.append(("raw", value))
        return value

    @app.workflow("ship")
    async def ship(ctx: WorkflowContext, customer: Customer) -> dict[str, datetime.date]:
        seen.append(("ship", customer))
        return {"at": customer.since}

    @app.workflow("checkout")
    async def checkout(ctx: WorkflowContext, order: Order) -> Receipt:
        seen.append(("checkout", order))
        got = await ctx.step("quote", order)  # a typed value in: its JSON form on the wire
        seen.append(("got", got))
        echoed = await ctx.step("raw", {"quote": got})  # unannotated step: JSON back
        seen.append(("echoed", echoed))
        shipped = await ctx.child("ship", order.customer)
        seen.append(("shipped", shipped))
        await ctx.sleep(3)
        return Receipt(order.customer.id, [got], shipped)

    return app


async def test_typed_inputs_and_outputs_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    seen: list[Any] = []
    app = shop(seen)
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            await engine.start("checkout", ORDER, run_id="c")  # typed in: stored as JSON
            output = await engine.result("c")
            assert trio.current_time() - start == 5  # the step's 2 s, the durable 3 s
            record = await engine.get("c")
            history = {r.step_id: r for r in await engine.history("c")}
    assert record.input == ORDER_JSON
    assert seen == [
        ("checkout", ORDER),
        ("quote", ORDER),
        ("got", QUOTE),
        ("raw", {"quote": QUOTE_JSON}),
        ("echoed", {"quote": QUOTE_JSON}),
        ("ship", CUSTOMER),
        ("shipped", {"at": datetime.date(2024, 2, 29)}),
    ]
    assert history["1"].output == QUOTE_JSON  # the wire and the store hold JSON
    assert output == {  # engine.result: the run's JSON output
        "customer": "12345678-1234-5678-1234-567812345678",
        "quotes": [QUOTE_JSON],
        "shipped": {"at": "2024-02-29"},
    }
    assert structure_as(output, Receipt, "r") == Receipt(
        CUSTOMER.id, [QUOTE], {"at": CUSTOMER.since}
    )


async def test_unannotated_stays_json_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    app = App("typed-plain")
    seen: list[Any] = []

    @app.step("echo")
    def echo(value):  # type: ignore[no-untyped-def]  # a thread step, unannotated
        seen.append(value)
        return value

    @app.workflow("plain")
    async def plain(ctx, value):  # type: ignore[no-untyped-def]
        seen.append(value)
        out = await ctx.step("echo", value)
        await ctx.sleep(1)
        return out

    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            output = await engine.result(await engine.start("plain", {"order": ORDER}))
            assert trio.current_time() - start == 1
    assert seen == [{"order": ORDER_JSON}] * 2
    assert output == {"order": ORDER_JSON}


async def test_a_bad_payload_fails_the_step_not_retried_naming_the_field(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    seen: list[Any] = []
    app = shop(seen)

    @app.workflow("bad")
    async def bad(ctx: WorkflowContext, order: Any) -> Any:
        try:
            await ctx.step("quote", order)
        except dt.StepFailed as exc:
            return [exc.attempts, exc.error.code, exc.error.retryable, exc.error.message]
        return "quoted"

    wrong = {**ORDER_JSON, "customer": {"id": "not-a-uuid", "since": "2024-02-29"}}
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            attempts, code, retryable, message = await engine.result(
                await engine.start("bad", wrong)
            )
            assert trio.current_time() - start == 0  # no retry, no backoff
            # The workflow's own input, likewise: the run fails naming the field.
            with pytest.raises(dt.RunFailed) as failed:
                await engine.result(await engine.start("checkout", {**ORDER_JSON, "total": 1.5}))
            assert trio.current_time() - start == 0
    assert (attempts, code, retryable) == (1, "payload_type", False)
    assert "the input of step 'quote' does not structure into Order" in message
    assert "$.customer.id" in message
    assert seen == []  # the step's code never ran
    assert failed.value.error["type"] == "PayloadTypeError"
    assert "the input of workflow 'checkout'" in failed.value.error["message"]
    assert "$.total" in failed.value.error["message"]


async def test_replay_after_a_restart_gives_the_same_typed_values(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    first: list[Any] = []
    second: list[Any] = []
    async with AsyncExitStack() as opened:
        backend, store = await opened.enter_async_context(open_store(every_store, "typed-shop"))
        app = shop(first)
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            await engine.start("checkout", ORDER, run_id="c")
            await trio.sleep(3)  # the step and the child done, mid-sleep: the engine closes
            assert [r.step_id for r in await engine.history("c")] == ["1", "2", "3", "4"]
        app = shop(second)
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            output = await engine.result("c")
            assert trio.current_time() - start == 5  # the sleep checkpointed at 2 s
    # The replay structured the very same values from the stored JSON; no step ran again.
    replayed = [entry for entry in second if entry[0] in ("checkout", "got", "echoed", "shipped")]
    assert replayed == [
        entry for entry in first if entry[0] in ("checkout", "got", "echoed", "shipped")
    ]
    assert [entry[0] for entry in second if entry[0] in ("quote", "raw", "ship")] == []
    assert output["quotes"] == [QUOTE_JSON]


async def test_a_remote_workflow_gets_the_same_typed_values_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    """The workflow's turns on a workflow worker: its context types by the worker's app."""
    seen: list[Any] = []
    app = shop(seen)
    remote = App(app.name)
    for name in ("checkout", "ship"):
        fn = app.workflows[name].fn
        assert fn is not None
        remote.workflow(name, remote=True)(fn)
    for definition in app.steps.values():
        remote.step(definition.name)(definition.fn)
    control = App(app.name)
    control.remote_workflow("checkout")
    control.remote_workflow("ship")
    async with open_store(every_store, app.name) as (backend, store):
        async with (
            open_worker(remote, backend),
            open_engine(control, backend, store=store) as engine,
        ):
            start = trio.current_time()
            await engine.start("checkout", ORDER, run_id="c")
            output = await engine.result("c")
            assert trio.current_time() - start == 5
    assert ("got", QUOTE) in seen
    assert ("shipped", {"at": datetime.date(2024, 2, 29)}) in seen
    assert output["quotes"] == [QUOTE_JSON]


# --------------------------------------------------------------------------- units


def test_signatures_from_annotations_and_forward_references() -> None:
    async def step(order: Order) -> list[Quote]:
        return []

    async def plain(value: dict[str, Any], other: int) -> dict[str, list[int]]:
        return {}

    async def bare(value):  # type: ignore[no-untyped-def]
        return value

    async def wf(ctx: WorkflowContext, size: Size) -> None: ...

    assert signature_of(step, 0).input is Order
    assert signature_of(step, 0).output == list[Quote]
    assert signature_of(plain, 0).input is PLAIN
    assert signature_of(plain, 0).output is PLAIN
    assert signature_of(bare, 0).input is PLAIN
    assert signature_of(wf, 1).input is Size
    assert signature_of(wf, 1).output is PLAIN


def test_typed_values_round_trip_and_bad_ones_name_the_field() -> None:
    assert to_json([ORDER, (1, 2)]) == [ORDER_JSON, [1, 2]]
    assert structure_as(ORDER_JSON, Order, "x") == ORDER
    assert to_json({"s": {1, 2}})["s"] == {1, 2}  # not typed: left for the JSON check
    with pytest.raises(PayloadTypeError) as caught:
        structure_as([ORDER_JSON, {**ORDER_JSON, "sizes": ["m"]}], list[Order], "the input")
    assert caught.value.path == "$[1].sizes[0]"
    assert "the input does not structure into list[Order]" in str(caught.value)
    with pytest.raises(PayloadTypeError, match=r"required field missing @ \$\.placed"):
        structure_as({k: v for k, v in ORDER_JSON.items() if k != "placed"}, Order, "x")
    with pytest.raises(PayloadTypeError, match="Decimal as a string"):
        structure_as(1.5, decimal.Decimal, "x")
    for value, kind in [(1.9, int), ("5", int), (True, int), (5, str), (1, bool), ("1", float)]:
        with pytest.raises(PayloadTypeError, match=f"expected {kind.__name__}"):
            structure_as(value, kind, "x")  # strict scalars: nothing converted silently
    assert structure_as(2, float, "x") == 2.0
    assert type(structure_as(2, float, "x")) is float


def test_an_output_of_another_type_and_an_unknown_annotation_are_payload_type_errors() -> None:
    with pytest.raises(PayloadTypeError, match=r"the output of step 'q' \(dict\) does not"):
        unstructure_as({"order_total": "1"}, Quote, "the output of step 'q'")
    assert PayloadTypeError("x").retryable is False
    assert PayloadTypeError("x").code == "payload_type"

    async def lost(value: NotDefinedAnywhere) -> None:  # type: ignore[name-defined]  # noqa: F821
        return None

    with pytest.raises(PayloadTypeError, match="NotDefinedAnywhere"):
        signature_of(lost, 0)


def test_pydantic_models_when_installed() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        name: str
        when: datetime.date

    item = Item(name="pen", when=datetime.date(2026, 1, 1))
    assert to_json({"i": item}) == {"i": {"name": "pen", "when": "2026-01-01"}}
    assert structure_as({"name": "pen", "when": "2026-01-01"}, Item, "x") == item
    with pytest.raises(PayloadTypeError) as caught:
        structure_as({"name": "pen", "when": "never"}, Item, "x")
    assert caught.value.path == "$.when"


async def test_pydantic_models_in_steps_and_workflows_at_exact_times(
    every_store: str, store_clock: trio.testing.MockClock
) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Item(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        name: str
        when: datetime.date

    app = App("typed-pydantic")
    seen: list[Any] = []

    async def stamp(item: Any) -> Any:
        seen.append(item)
        await trio.sleep(1)
        return Item(name=item.name.upper(), when=item.when + datetime.timedelta(days=1))

    async def flow(ctx: WorkflowContext, item: Any) -> Any:
        seen.append(item)
        return await ctx.step("stamp", item)

    # The annotations as objects (a model local to this test would not resolve as a string).
    stamp.__annotations__ = {"item": Item, "return": Item}
    flow.__annotations__ = {"ctx": WorkflowContext, "item": Item, "return": Item}
    app.step("stamp")(stamp)
    app.workflow("flow")(flow)
    async with open_store(every_store, app.name) as (backend, store):
        async with open_worker(app, backend), open_engine(app, backend, store=store) as engine:
            start = trio.current_time()
            run_id = await engine.start("flow", Item(name="pen", when=datetime.date(2026, 1, 1)))
            output = await engine.result(run_id)
            assert trio.current_time() - start == 1
            with pytest.raises(dt.RunFailed, match=r"\$\.when"):
                await engine.result(await engine.start("flow", {"name": "pen", "when": "never"}))
    assert seen == [Item(name="pen", when=datetime.date(2026, 1, 1))] * 2
    assert output == {"name": "PEN", "when": "2026-01-02"}
