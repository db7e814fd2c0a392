"""The PostgreSQL backend's schema migrations (``durable_trio._postgres._migrations``), on the
session's private server: applied once however many processes open at once, idempotent, and a
newer schema than the code knows is refused with a clear error."""

from __future__ import annotations

import uuid

import pytest
import trio

from _postgres_server import *  # noqa: F403  (the private server fixture)
from durable_trio._errors import BrokerError, ConfigError
from durable_trio._postgres._migrations import (
    Migration,
    check_schema_name,
    migrate,
    schema_versions,
)
from durable_trio._postgres._pool import open_pool

pytestmark = pytest.mark.postgres

STEPS = [
    Migration(1, "CREATE TABLE {schema}.things (id bigint PRIMARY KEY)", "things"),
    Migration(2, "ALTER TABLE {schema}.things ADD COLUMN name text", "their names"),
]


def _schema() -> str:
    return f"m_{uuid.uuid4().hex[:12]}"


async def test_steps_apply_once_under_concurrent_opens(postgres_url: str) -> None:
    schema = _schema()
    async with open_pool(postgres_url, size=8) as pool:
        versions: list[int] = []

        async def one() -> None:
            versions.append(await migrate(pool, schema, "things", STEPS))

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(one)
        assert versions == [2] * 6
        assert await schema_versions(pool, schema) == {"things": 2}
        await pool.execute(f'INSERT INTO "{schema}".things (id, name) VALUES (1, $1)', "a")
        assert await migrate(pool, schema, "things", STEPS) == 2  # idempotent
        assert await migrate(pool, schema, "things", STEPS[:2]) == 2


async def test_a_newer_schema_is_refused_clearly(postgres_url: str) -> None:
    schema = _schema()
    async with open_pool(postgres_url, size=2) as pool:
        await migrate(pool, schema, "things", STEPS)
        with pytest.raises(BrokerError, match=r"version 2 of the things's tables, newer"):
            await migrate(pool, schema, "things", STEPS[:1])


async def test_a_failing_step_keeps_the_ones_before(postgres_url: str) -> None:
    schema = _schema()
    bad = [*STEPS[:1], Migration(2, "ALTER TABLE {schema}.nothing ADD COLUMN x int")]
    async with open_pool(postgres_url, size=2) as pool:
        with pytest.raises(Exception, match="nothing"):
            await migrate(pool, schema, "things", bad)
        assert await schema_versions(pool, schema) == {"things": 1}
        assert await migrate(pool, schema, "things", STEPS) == 2


def test_schema_names_are_plain_identifiers() -> None:
    assert check_schema_name("durable_trio") == "durable_trio"
    for bad in ("Durable", "a-b", "1a", 'x"; DROP', "a" * 64, ""):
        with pytest.raises(ConfigError, match="schema name"):
            check_schema_name(bad)
    with pytest.raises(ValueError, match="1, 2"):
        trio.run(migrate, None, "s", "p", [Migration(2, "")])  # type: ignore[arg-type]
