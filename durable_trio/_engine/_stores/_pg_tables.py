"""The PostgreSQL run store's tables (its migrations, part ``"runs"``) and the SQL of its reads
and changes; :class:`~.postgres.PostgresRunStore` runs them.

``{schema}`` in each statement stands for the quoted schema. Columns and JSON encoding are the
SQLite store's (``_sqlite_tables.py``): JSON values as JSON text (``text``, not ``jsonb``, which
would reorder keys, drop duplicates and refuse ``\\u0000``), times as ``double precision`` on the
store's clock, and rows are read back into records by the same functions. Identifiers are
``COLLATE "C"`` (code point order, as Python sorts ``str``: a tenant's ids are an index range).

How each change stays atomic under concurrent writers (``READ COMMITTED``, every statement of a
transaction on a fresh snapshot):

- A change that depends on a run's state locks the run's row first (``FOR SHARE``, or ``FOR NO
  KEY UPDATE`` to append a signal), then writes: ending a run waits for it, and a run that ended
  first is seen ended. Rows of a run are always locked run first, then its checkpoints, so two
  changes never wait on each other in a circle.
- Ending a run deletes its cancel mark in a second statement of the same transaction, on a fresh
  snapshot: a mark written by a guarded begin that held the run's row before the end is seen and
  deleted (one statement would look at a snapshot taken before that mark committed).
- An insert ``ON CONFLICT DO NOTHING`` waits for a concurrent insert of the same key, then the
  next statement reads the row that won.
"""

from __future__ import annotations

from typing import Final

from ..._postgres._migrations import Migration
from .._records import CANCEL_STEP_ID, RunStatus
from ._generation_tables import backfill_ends
from ._sqlite_tables import _RUN_COLUMNS, _STEP_COLUMNS

__all__ = ["RUNS_MIGRATIONS"]

_TERMINAL: Final = ", ".join(f"'{s.value}'" for s in RunStatus if s.terminal)

# The functions of migration 9 (issue 32): what were two or three statements of one
# transaction, one call. A VOLATILE function's every statement takes a fresh snapshot (READ
# COMMITTED), as the separate statements of a transaction did: the same locks, in the same
# order, and the same answers (see the module docs and UPDATE_STEP_CALL below).
_FUNCTIONS: Final = f"""
    CREATE FUNCTION {{schema}}.dt_update_step(
        p_ns text, p_run text, p_step text, p_status text, p_attempt bigint, p_output text,
        p_error text, p_wake_at float8, p_dispatched boolean, p_now float8, p_heartbeat text,
        p_attempts text, p_expect bigint
    ) RETURNS text LANGUAGE plpgsql VOLATILE AS $fn$
    DECLARE
        run_status text;
        step_status text;
    BEGIN
        -- The run's row locked (a locking read sees its latest version): it cannot end, nor
        -- change at all, until this transaction ends; its status read here stays true.
        SELECT r.status INTO run_status FROM {{schema}}.runs AS r
        WHERE r.namespace = p_ns AND r.run_id = p_run FOR SHARE;
        IF run_status IS NULL THEN
            RETURN 'missing';
        END IF;
        IF run_status NOT IN ({_TERMINAL}) THEN
            UPDATE {{schema}}.run_steps AS s SET status = p_status, attempt = p_attempt,
                output = p_output, error = p_error, wake_at = p_wake_at,
                dispatched = p_dispatched, updated_at = p_now,
                heartbeat = coalesce(p_heartbeat, s.heartbeat), attempts = p_attempts
            WHERE s.namespace = p_ns AND s.run_id = p_run AND s.step_id = p_step
              AND s.status = 'pending' AND s.attempt = p_expect;
            IF FOUND THEN
                RETURN 'applied';
            END IF;
        END IF;
        SELECT s.status INTO step_status FROM {{schema}}.run_steps AS s
        WHERE s.namespace = p_ns AND s.run_id = p_run AND s.step_id = p_step;
        IF step_status IS NULL THEN
            RETURN 'missing';
        ELSIF run_status IN ({_TERMINAL}) THEN
            RETURN 'run_finished';
        ELSIF step_status <> 'pending' THEN
            RETURN 'duplicate';
        END IF;
        RETURN 'stale';
    END
    $fn$;
    CREATE FUNCTION {{schema}}.dt_finish_run(
        p_ns text, p_run text, p_status text, p_output text, p_error text, p_now float8
    ) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
    BEGIN
        UPDATE {{schema}}.runs SET status = p_status, output = p_output, error = p_error,
            owner = NULL, lease_until = NULL, updated_at = p_now
        WHERE namespace = p_ns AND run_id = p_run
          AND status IN ('pending', 'running', 'blocked');
        IF FOUND THEN  -- ended by this call: its status is the one just written
            IF p_status IN ('{RunStatus.COMPLETED.value}', '{RunStatus.FAILED.value}') THEN
                DELETE FROM {{schema}}.run_steps
                WHERE namespace = p_ns AND run_id = p_run AND step_id = '{CANCEL_STEP_ID}';
            END IF;
            RETURN true;
        END IF;
        -- Ended before: its stale cancel mark, on a fresh snapshot (see the module docs).
        DELETE FROM {{schema}}.run_steps
        WHERE namespace = p_ns AND run_id = p_run AND step_id = '{CANCEL_STEP_ID}'
          AND EXISTS (SELECT 1 FROM {{schema}}.runs WHERE namespace = p_ns AND run_id = p_run
                      AND status IN ('{RunStatus.COMPLETED.value}', '{RunStatus.FAILED.value}'));
        RETURN false;
    END
    $fn$
"""

#: The run store's steps of the schema (part ``"runs"``, see ``_postgres/_migrations.py``).
RUNS_MIGRATIONS: Final = (
    Migration(
        1,
        """
        CREATE TABLE {schema}.runs (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            seq bigint GENERATED ALWAYS AS IDENTITY,
            workflow text COLLATE "C" NOT NULL,
            status text NOT NULL,
            input text NOT NULL,
            output text NOT NULL DEFAULT 'null',
            error text NOT NULL DEFAULT 'null',
            owner text COLLATE "C",
            lease_until double precision,
            created_at double precision NOT NULL,
            updated_at double precision NOT NULL,
            timeout double precision,
            trace text,
            parent text COLLATE "C",
            depth integer NOT NULL DEFAULT 0,
            PRIMARY KEY (namespace, run_id)
        );
        CREATE INDEX runs_seq ON {schema}.runs (namespace, seq);
        CREATE INDEX runs_active ON {schema}.runs (namespace, seq)
            WHERE status IN ('pending', 'running');
        CREATE INDEX runs_status ON {schema}.runs (namespace, status, seq);
        CREATE INDEX runs_workflow ON {schema}.runs (namespace, workflow, seq);
        CREATE TABLE {schema}.run_steps (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            step_id text COLLATE "C" NOT NULL,
            position numeric NOT NULL,
            kind text NOT NULL,
            name text NOT NULL,
            status text NOT NULL,
            attempt bigint NOT NULL,
            input text NOT NULL,
            output text NOT NULL,
            error text NOT NULL,
            retry text NOT NULL,
            wake_at double precision,
            dispatched boolean NOT NULL,
            priority bigint,
            created_at double precision NOT NULL,
            updated_at double precision NOT NULL,
            heartbeat_timeout double precision,
            heartbeat text,
            attempts text,
            PRIMARY KEY (namespace, run_id, step_id)
        );
        CREATE TABLE {schema}.run_schedules (
            namespace text COLLATE "C" NOT NULL,
            name text COLLATE "C" NOT NULL,
            spec text NOT NULL,
            last_tick double precision,
            PRIMARY KEY (namespace, name)
        );
        CREATE TABLE {schema}.run_signals (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            name text COLLATE "C" NOT NULL,
            seq bigint NOT NULL,
            payload text NOT NULL,
            PRIMARY KEY (namespace, run_id, name, seq)
        );
        CREATE TABLE {schema}.run_events (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            value text NOT NULL,
            PRIMARY KEY (namespace, run_id, key)
        )
        """,
        "runs, checkpoints, schedules, signals, events",
    ),
    Migration(
        2,
        "ALTER TABLE {schema}.run_schedules ADD COLUMN IF NOT EXISTS state text",
        "the schedules' overlap state",
    ),
    Migration(
        3,
        """
        CREATE TABLE {schema}.run_dedup_keys (
            namespace text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            PRIMARY KEY (namespace, key)
        );
        CREATE TABLE {schema}.run_debounced (
            namespace text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            workflow text COLLATE "C" NOT NULL,
            input text NOT NULL,
            timeout double precision,
            trace text,
            due_at double precision NOT NULL,
            deadline double precision,
            PRIMARY KEY (namespace, key)
        );
        CREATE INDEX run_debounced_due ON {schema}.run_debounced (namespace, due_at);
        CREATE INDEX run_debounced_run ON {schema}.run_debounced (namespace, run_id)
        """,
        "dedup keys and debounced starts (issue 33, item 4: _pg_starts.py)",
    ),
    Migration(
        4,
        """
        ALTER TABLE {schema}.runs ADD COLUMN tags text;
        CREATE TABLE {schema}.run_tags (
            namespace text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            value text COLLATE "C" NOT NULL,
            seq bigint NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            PRIMARY KEY (namespace, key, value, seq)
        )
        """,
        "run tags and their index (issue 34)",
    ),
    # Issue 34 (retention): the finished runs by end time, all and per workflow (partial: the
    # unfinished runs stay out), so a prune walks from the oldest end, never every run.
    Migration(
        5,
        """
        CREATE INDEX runs_ended ON {schema}.runs (namespace, updated_at)
            WHERE status IN ('completed', 'failed', 'cancelled');
        CREATE INDEX runs_ended_workflow ON {schema}.runs (namespace, workflow, updated_at)
            WHERE status IN ('completed', 'failed', 'cancelled')
        """,
        "the finished runs by end time (retention)",
    ),
    # Issue 34, item 5 (continue-as-new): a run's previous generations, run_steps' columns
    # and the generation (_pg_generations.py).
    Migration(
        6,
        """
        CREATE TABLE {schema}.run_generations (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            generation bigint NOT NULL,
            step_id text COLLATE "C" NOT NULL,
            position numeric NOT NULL,
            kind text NOT NULL,
            name text NOT NULL,
            status text NOT NULL,
            attempt bigint NOT NULL,
            input text NOT NULL,
            output text NOT NULL,
            error text NOT NULL,
            retry text NOT NULL,
            wake_at double precision,
            dispatched boolean NOT NULL,
            priority bigint,
            created_at double precision NOT NULL,
            updated_at double precision NOT NULL,
            heartbeat_timeout double precision,
            heartbeat text,
            attempts text,
            PRIMARY KEY (namespace, run_id, generation, step_id)
        )
        """,
        "a run's previous generations (continue-as-new)",
    ),
    # Issue 33: a run's dedup key row, found by its run, is deleted with the run (retention).
    Migration(
        7,
        "CREATE INDEX run_dedup_keys_run ON {schema}.run_dedup_keys (namespace, run_id)",
        "the dedup keys by run (deleted with their run by retention)",
    ),
    Migration(
        8,
        "ALTER TABLE {schema}.run_debounced ADD COLUMN tags text",
        "the tags of a debounced start (the latest start's)",
    ),
    # Issue 32: a checkpoint's compare-and-set and a run's end, each ONE statement from the
    # client (their statements inside a function: see _UPDATE_STEP_FUNCTION).
    Migration(9, _FUNCTIONS, "update_step and finish_run as functions (one statement each)"),
    # Issue 34, item 5: when each previous generation ended (retention of generations,
    # _pg_generations.py), the generations archived before it backfilled.
    Migration(
        10,
        """
        CREATE TABLE {schema}.run_generation_ends (
            namespace text COLLATE "C" NOT NULL,
            run_id text COLLATE "C" NOT NULL,
            generation bigint NOT NULL,
            workflow text COLLATE "C" NOT NULL,
            ended_at double precision NOT NULL,
            PRIMARY KEY (namespace, run_id, generation)
        );
        CREATE INDEX run_generation_ends_at ON {schema}.run_generation_ends (namespace, ended_at);
        CREATE INDEX run_generation_ends_workflow
            ON {schema}.run_generation_ends (namespace, workflow, ended_at);
        """
        + backfill_ends(
            "{schema}.run_generation_ends", "{schema}.run_generations", "{schema}.run_steps",
            "{schema}.runs",
        ),
        "when each previous generation ended (retention of generations)",
    ),
    # A run's stored tags as an object for the prune, NULL when they are damaged (not JSON, not
    # an object, a \u0000 jsonb refuses): a cast in the prune itself would fail the whole
    # statement, and every prune after it, on one damaged row. PostgreSQL 15 has no
    # pg_input_is_valid, so the cast's error is caught (a subtransaction, for tagged runs only).
    Migration(
        11,
        """
        CREATE FUNCTION {schema}.dt_tags_object(p_tags text) RETURNS jsonb
        LANGUAGE plpgsql IMMUTABLE STRICT AS $f$
        DECLARE
            parsed jsonb;
        BEGIN
            parsed := p_tags::jsonb;
            IF jsonb_typeof(parsed) = 'object' THEN
                RETURN parsed;
            END IF;
            RETURN NULL;
        EXCEPTION WHEN data_exception THEN
            RETURN NULL;
        END
        $f$
        """,
        "a run's tags for the prune, NULL when damaged",
    ),
)

RUN_COLUMNS: Final = _RUN_COLUMNS
STEP_COLUMNS: Final = _STEP_COLUMNS

#: A condition on the run ($1 namespace, $2 run id): it exists and is not over.
_RUN_UNFINISHED: Final = f"""EXISTS (
    SELECT 1 FROM {{schema}}.runs
    WHERE namespace = $1 AND run_id = $2 AND status NOT IN ({_TERMINAL}))"""

# -- runs ------------------------------------------------------------------------------------

INSERT_RUN: Final = """
    INSERT INTO {schema}.runs (namespace, run_id, workflow, input, status, created_at,
        updated_at, output, error, owner, lease_until, timeout, trace, parent, depth, tags)
    VALUES ($1, $2, $3, $4, $5, $6, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
    ON CONFLICT (namespace, run_id) DO NOTHING
"""
GET_RUN: Final = f"SELECT {RUN_COLUMNS} FROM {{schema}}.runs WHERE namespace = $1 AND run_id = $2"
RUN_STATUS_FOR_SHARE: Final = """
    SELECT status FROM {schema}.runs WHERE namespace = $1 AND run_id = $2 FOR SHARE
"""
RUN_STATUS_FOR_UPDATE: Final = """
    SELECT status FROM {schema}.runs WHERE namespace = $1 AND run_id = $2 FOR NO KEY UPDATE
"""

# Orphans locked as they are picked (a run another claim holds is skipped, not waited for; a
# row changed since the snapshot is checked again before it is taken), in a CTE: evaluated
# once (a subquery under the UPDATE may run again and take more than its LIMIT). A lease that
# is no time (infinity, NaN: damaged data; both sort above every number) has expired.
CLAIM: Final = f"""
    WITH orphans AS MATERIALIZED (
        SELECT run_id FROM {{schema}}.runs
        WHERE namespace = $1 AND status IN ('pending', 'running')
          AND (owner IS NULL OR lease_until IS NULL OR lease_until < $4::float8
               OR ($5::boolean AND owner = $2::text)
               OR lease_until IN ('Infinity'::float8, 'NaN'::float8))
        ORDER BY seq LIMIT $6::bigint FOR NO KEY UPDATE SKIP LOCKED
    )
    UPDATE {{schema}}.runs AS r
    SET owner = $2::text, lease_until = $3::float8, status = 'running', updated_at = $4::float8
    FROM orphans AS o
    WHERE r.namespace = $1 AND r.run_id = o.run_id
    RETURNING r.seq, {", ".join("r." + c.strip() for c in RUN_COLUMNS.split(","))}
"""
RENEW: Final = """
    UPDATE {schema}.runs SET lease_until = $4::float8
    WHERE namespace = $1 AND run_id = ANY($2::text[]) AND owner = $3::text
      AND status IN ('pending', 'running')
    RETURNING run_id
"""
RELEASE: Final = """
    UPDATE {schema}.runs SET owner = NULL, lease_until = NULL, status = 'pending',
        updated_at = $4::float8
    WHERE namespace = $1 AND run_id = ANY($2::text[]) AND owner = $3::text
      AND status IN ('pending', 'running')
"""
FINISH: Final = """
    UPDATE {schema}.runs SET status = $3, output = $4, error = $5, owner = NULL,
        lease_until = NULL, updated_at = $6
    WHERE namespace = $1 AND run_id = $2 AND status IN ('pending', 'running', 'blocked')
"""
# The cancel mark of a run that ended otherwise (docs/engine.md, "A cancel racing the run's
# end"): the second statement of the end's transaction (see the module docs).
DROP_MARK_IF_ENDED: Final = f"""
    DELETE FROM {{schema}}.run_steps
    WHERE namespace = $1 AND run_id = $2 AND step_id = '{CANCEL_STEP_ID}'
      AND EXISTS (SELECT 1 FROM {{schema}}.runs WHERE namespace = $1 AND run_id = $2
                  AND status IN ('{RunStatus.COMPLETED.value}', '{RunStatus.FAILED.value}'))
"""
#: :data:`FINISH` then :data:`DROP_MARK_IF_ENDED` on a fresh snapshot: one call (migration 9),
#: answering whether the run was ended by it.
FINISH_CALL: Final = """
    SELECT {schema}.dt_finish_run($1::text, $2::text, $3::text, $4::text, $5::text, $6::float8)
"""
DROP_MARK: Final = f"""
    DELETE FROM {{schema}}.run_steps
    WHERE namespace = $1 AND run_id = $2 AND step_id = '{CANCEL_STEP_ID}'
"""
REOPEN_RUN: Final = """
    UPDATE {schema}.runs SET status = 'pending', owner = NULL, lease_until = NULL,
        output = 'null', error = 'null', timeout = $3::float8, updated_at = $4::float8
    WHERE namespace = $1 AND run_id = $2 AND status IN ('failed', 'blocked')
"""
REOPEN_STEP: Final = """
    UPDATE {schema}.run_steps SET status = $4, attempt = $5, error = $6, retry = $7,
        wake_at = $8::float8, dispatched = $9, updated_at = $10, attempts = $11
    WHERE namespace = $1 AND run_id = $2 AND step_id = $3
"""
COUNT_RUNS: Final = (
    "SELECT status, count(*) FROM {schema}.runs WHERE namespace = $1 GROUP BY status"
)
NAMESPACES: Final = """
    SELECT namespace FROM {schema}.runs UNION SELECT namespace FROM {schema}.run_schedules
    ORDER BY 1
"""

# -- checkpoints -----------------------------------------------------------------------------

# Typed parameters: the values come through a SELECT (so a guard can refuse them), where the
# target columns do not type them.
_STEP_VALUES: Final = (
    "$1::text, $2::numeric, $3::text, $4::text, $5::text, $6::text, $7::text, $8::bigint, "
    "$9::text, $10::text, $11::text, $12::text, $13::float8, $14::boolean, $15::bigint, "
    "$16::float8, $16::float8, $17::float8, $18::text, $19::text"
)
INSERT_STEP: Final = f"""
    INSERT INTO {{schema}}.run_steps (namespace, position, {STEP_COLUMNS})
    SELECT {_STEP_VALUES}
    ON CONFLICT (namespace, run_id, step_id) DO NOTHING
"""
#: :data:`INSERT_STEP` only while the run exists unfinished ($1 namespace, $3 run id).
INSERT_STEP_GUARDED: Final = f"""
    INSERT INTO {{schema}}.run_steps (namespace, position, {STEP_COLUMNS})
    SELECT {_STEP_VALUES}
    WHERE EXISTS (SELECT 1 FROM {{schema}}.runs WHERE namespace = $1 AND run_id = $3
                  AND status NOT IN ({_TERMINAL}))
    ON CONFLICT (namespace, run_id, step_id) DO NOTHING
"""
GET_STEPS: Final = f"""
    SELECT {STEP_COLUMNS} FROM {{schema}}.run_steps WHERE namespace = $1 AND run_id = $2
    ORDER BY position, step_id
"""
GET_STEP: Final = f"""
    SELECT {STEP_COLUMNS} FROM {{schema}}.run_steps
    WHERE namespace = $1 AND run_id = $2 AND step_id = $3
"""
GET_STEPS_MANY: Final = f"""
    SELECT {STEP_COLUMNS} FROM {{schema}}.run_steps
    WHERE namespace = $1
      AND (run_id, step_id) IN (SELECT * FROM unnest($2::text[], $3::text[]))
"""
# The compare-and-set (dt_update_step, migration 9), after the run's row is locked FOR SHARE
# (it cannot end meanwhile); two writers of one checkpoint: the second waits, then finds it
# changed and writes nothing; then the checkpoint's state on a fresh snapshot when nothing was
# written. One call, answering an ``Applied`` value.
UPDATE_STEP_CALL: Final = """
    SELECT {schema}.dt_update_step($1::text, $2::text, $3::text, $4::text, $5::bigint,
        $6::text, $7::text, $8::float8, $9::boolean, $10::float8, $11::text, $12::text,
        $13::bigint)
"""
MARK_DISPATCHED: Final = """
    UPDATE {schema}.run_steps SET dispatched = true
    WHERE namespace = $1 AND run_id = $2 AND step_id = $3 AND status = 'pending'
      AND attempt = $4
"""

# -- schedules -------------------------------------------------------------------------------

PUT_SCHEDULE: Final = """
    INSERT INTO {schema}.run_schedules (namespace, name, spec) VALUES ($1, $2, $3)
    ON CONFLICT (namespace, name) DO UPDATE SET spec = excluded.spec
"""
ADD_SCHEDULE: Final = """
    INSERT INTO {schema}.run_schedules (namespace, name, spec) VALUES ($1, $2, $3)
    ON CONFLICT (namespace, name) DO NOTHING
"""
GET_SCHEDULES: Final = """
    SELECT name, spec, last_tick FROM {schema}.run_schedules WHERE namespace = $1 ORDER BY name
"""
DELETE_SCHEDULE: Final = "DELETE FROM {schema}.run_schedules WHERE namespace = $1 AND name = $2"
MARK_SCHEDULE_TICK: Final = """
    UPDATE {schema}.run_schedules SET last_tick = $3::float8
    WHERE namespace = $1 AND name = $2 AND (last_tick IS NULL OR last_tick < $3::float8)
"""

GET_SCHEDULE_STATES: Final = """
    SELECT name, state FROM {schema}.run_schedules WHERE namespace = $1 AND state IS NOT NULL
"""
PUT_SCHEDULE_STATE: Final = """
    UPDATE {schema}.run_schedules SET state = $3 WHERE namespace = $1 AND name = $2
"""

# -- signals and events ----------------------------------------------------------------------

# After the run's row is locked FOR NO KEY UPDATE: appenders of one run take turns, so the
# next number is read after the previous append committed.
APPEND_SIGNAL: Final = f"""
    INSERT INTO {{schema}}.run_signals (namespace, run_id, name, seq, payload)
    SELECT $1::text, $2::text, $3::text, coalesce(max(seq), 0) + 1, $4::text
    FROM {{schema}}.run_signals WHERE namespace = $1 AND run_id = $2 AND name = $3
    HAVING {_RUN_UNFINISHED}
    RETURNING seq
"""
READ_SIGNAL: Final = """
    SELECT payload FROM {schema}.run_signals
    WHERE namespace = $1 AND run_id = $2 AND name = $3 AND seq = $4
"""
PUT_EVENT: Final = """
    INSERT INTO {schema}.run_events (namespace, run_id, key, value) VALUES ($1, $2, $3, $4)
    ON CONFLICT (namespace, run_id, key) DO UPDATE SET value = excluded.value
"""
GET_EVENTS: Final = """
    SELECT key, value FROM {schema}.run_events WHERE namespace = $1 AND run_id = $2
"""
NOTIFY: Final = "SELECT pg_notify($1, $2)"
#: A signal's wake ($3 channel, $4 payload): sent only if the signal was stored (the run is
#: unfinished: the append's own condition), and, as every ``NOTIFY``, only once it commits.
NOTIFY_IF_UNFINISHED: Final = f"SELECT pg_notify($3, $4) WHERE {_RUN_UNFINISHED}"

# -- run tags (issue 34) ---------------------------------------------------------------------

#: The tag index rows of a run just inserted ($1 namespace, $2 run id, $3 keys, $4 values, $5
#: its tags as stored): only while the stored run carries those very tags (a start of an
#: existing id with other tags indexes nothing), each once (``ON CONFLICT``).
INSERT_RUN_TAGS: Final = """
    INSERT INTO {schema}.run_tags (namespace, key, value, seq, run_id)
    SELECT r.namespace, t.key, t.value, r.seq, r.run_id
    FROM {schema}.runs AS r, unnest($3::text[], $4::text[]) AS t(key, value)
    WHERE r.namespace = $1 AND r.run_id = $2 AND r.tags = $5::text
    ON CONFLICT DO NOTHING
"""

# -- retention (issue 34) ----------------------------------------------------------------------

# $1 namespace, $2 ended before, $3 workflow (NULL: any). A child whose parent exists unfinished
# is kept (the parent may not have recorded its end yet).
_PRUNABLE: Final = f"""
    FROM {{schema}}.runs AS r
    WHERE r.namespace = $1 AND r.status IN ({_TERMINAL}) AND r.updated_at < $2::float8
      AND ($3::text IS NULL OR r.workflow = $3::text)
      AND NOT EXISTS (
          SELECT 1 FROM {{schema}}.runs AS p
          WHERE p.namespace = $1 AND p.run_id = r.parent AND p.status NOT IN ({_TERMINAL}))
"""


def _prune(of_workflow: bool) -> str:
    """The prune ($4 limit): the runs picked, locked (one another prune holds is skipped, not
    waited for), deleted with their checkpoints, signals, events and tag index rows (found by
    their tags: the index's own key) and the dedup key row still naming it (a row a newer
    run of the key took over names that run: kept) in one statement (one transaction: each
    run whole or gone)."""
    workflow = " AND r.workflow = $3::text" if of_workflow else ""
    return f"""
    WITH doomed AS MATERIALIZED (
        SELECT r.run_id, r.seq, r.tags {_PRUNABLE}{workflow}
        ORDER BY r.updated_at LIMIT $4::bigint FOR UPDATE OF r SKIP LOCKED
    ), tags AS (
        DELETE FROM {{schema}}.run_tags AS t
        USING doomed AS d, jsonb_each_text({{schema}}.dt_tags_object(d.tags)) AS j(key, value)
        WHERE t.namespace = $1 AND t.key = j.key AND t.value = j.value AND t.seq = d.seq
    ), steps AS (
        DELETE FROM {{schema}}.run_steps AS s USING doomed AS d
        WHERE s.namespace = $1 AND s.run_id = d.run_id
    ), generations AS (
        DELETE FROM {{schema}}.run_generations AS g USING doomed AS d
        WHERE g.namespace = $1 AND g.run_id = d.run_id
    ), generation_ends AS (
        DELETE FROM {{schema}}.run_generation_ends AS g USING doomed AS d
        WHERE g.namespace = $1 AND g.run_id = d.run_id
    ), signals AS (
        DELETE FROM {{schema}}.run_signals AS s USING doomed AS d
        WHERE s.namespace = $1 AND s.run_id = d.run_id
    ), events AS (
        DELETE FROM {{schema}}.run_events AS e USING doomed AS d
        WHERE e.namespace = $1 AND e.run_id = d.run_id
    ), dedup AS (
        DELETE FROM {{schema}}.run_dedup_keys AS k USING doomed AS d
        WHERE k.namespace = $1 AND k.run_id = d.run_id
    )
    DELETE FROM {{schema}}.runs AS r USING doomed AS d
    WHERE r.namespace = $1 AND r.run_id = d.run_id
    RETURNING r.run_id
    """


PRUNE_FINISHED: Final = _prune(False)
PRUNE_FINISHED_OF: Final = _prune(True)
COUNT_FINISHED: Final = f"SELECT count(*) {_PRUNABLE}"
# A loose index scan of runs_ended_workflow: one step per workflow, not per run.
FINISHED_WORKFLOWS: Final = f"""
    WITH RECURSIVE w(name) AS (
        SELECT min(workflow) FROM {{schema}}.runs WHERE namespace = $1 AND status IN ({_TERMINAL})
        UNION ALL
        SELECT (SELECT min(workflow) FROM {{schema}}.runs
                WHERE namespace = $1 AND status IN ({_TERMINAL}) AND workflow > w.name)
        FROM w WHERE w.name IS NOT NULL
    )
    SELECT name FROM w WHERE name IS NOT NULL
"""
