"""A traced process for the cross-process trace test (tests/test_telemetry_processes.py).

    python tests/_otel_process.py worker URL SPANFILE   # serves the steps until killed
    python tests/_otel_process.py engine URL SPANFILE   # runs one 3-step run, prints its output

Each process turns telemetry on (``dt.instrument``) with a tracer provider whose exporter
appends every finished span to SPANFILE as one JSON line (written as each span ends, so a
worker killed afterwards has lost none); the test joins the two files.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

import orjson
import trio
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

import durable_trio as dt

if TYPE_CHECKING:
    from collections.abc import Sequence

    from opentelemetry.sdk.trace import ReadableSpan

app = dt.App("traced")


@app.step("reserve")
async def reserve(order: dict[str, Any]) -> str:
    return f"reserved {order['id']}"


@app.step("charge")
async def charge(order: dict[str, Any]) -> int:
    return int(order["amount"])


@app.step("ship")
async def ship(order: dict[str, Any]) -> str:
    return "shipped"


@app.workflow("order")
async def order(ctx: dt.WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    return {
        "reserved": await ctx.step("reserve", order),
        "charged": await ctx.step("charge", order),
        "shipped": await ctx.step("ship", order),
    }


class JsonLinesExporter(SpanExporter):
    """Appends each span as one JSON line: its name, ids, parent, attributes and process."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        for span in spans:
            context = span.context
            assert context is not None
            line = {
                "name": span.name,
                "trace": f"{context.trace_id:032x}",
                "span": f"{context.span_id:016x}",
                "parent": None if span.parent is None else f"{span.parent.span_id:016x}",
                "remoteParent": span.parent is not None and span.parent.is_remote,
                "attributes": dict(span.attributes or {}),
                "pid": os.getpid(),
            }
            self._out.write(orjson.dumps(line).decode() + "\n")
        self._out.flush()
        return SpanExportResult.SUCCESS


async def main(role: str, url: str, out: TextIO) -> None:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(out)))
    dt.instrument(tracer_provider=provider)
    async with dt.open_backend(url) as backend:
        if role == "worker":
            async with dt.open_worker(app, backend, concurrency=4):
                print("ready", flush=True)
                await trio.sleep_forever()
        async with dt.open_engine(app, backend) as engine:
            run_id = await engine.start("order", {"id": 7, "amount": 5}, run_id="traced-1")
            with trio.fail_after(30):
                output = await engine.result(run_id)
    provider.shutdown()
    print(orjson.dumps(output).decode(), flush=True)


if __name__ == "__main__":
    role, url, spans = sys.argv[1:4]
    with open(spans, "a", buffering=1) as spans_file:
        trio.run(main, role, url, spans_file)
