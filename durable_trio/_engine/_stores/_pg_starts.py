"""The SQL of the PostgreSQL run store's dedup keys and debounced starts (issue 33, item 4; the
tables are migration 2 of ``_pg_tables.py``), and how each change stays atomic:

- A deduped start takes its key's row lock first (an ``INSERT ... ON CONFLICT DO NOTHING`` of
  the key naming the new run, then ``SELECT ... FOR UPDATE``): two starts of one key are
  serialized; the second sees the first's run (committed) and returns it while it is unfinished.
- A debounced start is one upsert: a start not yet started is folded into (latest input, due
  at ``LEAST(now + delay, deadline)``: ``LEAST`` ignores a ``NULL`` deadline), else recorded.
- Starting the due ones deletes their rows (``FOR UPDATE SKIP LOCKED``: a row another engine
  is starting, or a start is folding into, is left to the next round) and inserts their runs in
  the same transaction. A fold waiting on a row being deleted inserts a new row when the delete
  commits: a new window, a new run.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "DEBOUNCE",
    "DEBOUNCED_DUE",
    "DEDUP_KEY_FOR_UPDATE",
    "INSERT_DEDUP_KEY",
    "INSERT_STARTED",
    "SET_DEDUP_KEY",
    "SOONEST_DEBOUNCED",
    "TAKE_DUE",
]

INSERT_DEDUP_KEY: Final = """
    INSERT INTO {schema}.run_dedup_keys (namespace, key, run_id) VALUES ($1, $2, $3)
    ON CONFLICT (namespace, key) DO NOTHING
"""
DEDUP_KEY_FOR_UPDATE: Final = """
    SELECT run_id FROM {schema}.run_dedup_keys WHERE namespace = $1 AND key = $2 FOR UPDATE
"""
SET_DEDUP_KEY: Final = """
    UPDATE {schema}.run_dedup_keys SET run_id = $3 WHERE namespace = $1 AND key = $2
"""
# $1 namespace, $2 key, $3 run id, $4 workflow, $5 input, $6 timeout, $7 trace, $8 now,
# $9 delay, $10 max wait (NULL: no deadline), $11 tags (NULL: none; the latest start's win).
DEBOUNCE: Final = """
    INSERT INTO {schema}.run_debounced AS d (namespace, key, run_id, workflow, input, timeout,
        trace, due_at, deadline, tags)
    VALUES ($1, $2, $3, $4, $5, $6::float8, $7, $8::float8 + $9::float8,
        $8::float8 + $10::float8, $11::text)
    ON CONFLICT (namespace, key) DO UPDATE SET input = excluded.input,
        timeout = excluded.timeout, trace = excluded.trace, tags = excluded.tags,
        due_at = LEAST(excluded.due_at, d.deadline)
    RETURNING d.run_id
"""
# (The due keys picked once, MATERIALIZED: a LIMIT subquery joined in place may be run again
# by the plan, and so delete more than the limit.)
# A due time of NaN (damaged data; it sorts above every number, so it was never due, and the
# soonest of them all was NaN: the loop read again at once, for ever) is due now.
TAKE_DUE: Final = """
    WITH due AS MATERIALIZED (
        SELECT key FROM {schema}.run_debounced
        WHERE namespace = $1 AND (due_at <= $2::float8 OR due_at = 'NaN'::float8)
        ORDER BY due_at LIMIT $3::bigint FOR UPDATE SKIP LOCKED
    )
    DELETE FROM {schema}.run_debounced AS d USING due
    WHERE d.namespace = $1 AND d.key = due.key
    RETURNING d.run_id, d.workflow, d.input, d.timeout, d.trace, d.due_at, d.tags
"""
# The run of a debounced start: pending, no owner, its input the stored JSON text.
# $1 namespace, $2 run id, $3 workflow, $4 input, $5 now, $6 timeout, $7 trace, $8 tags.
INSERT_STARTED: Final = """
    INSERT INTO {schema}.runs (namespace, run_id, workflow, input, status, created_at,
        updated_at, timeout, trace, tags)
    VALUES ($1, $2, $3, $4, 'pending', $5::float8, $5::float8, $6::float8, $7, $8::text)
    ON CONFLICT (namespace, run_id) DO NOTHING
"""
SOONEST_DEBOUNCED: Final = """
    SELECT min(due_at) FROM {schema}.run_debounced WHERE namespace = $1 AND due_at <> 'NaN'
"""
DEBOUNCED_DUE: Final = """
    SELECT due_at FROM {schema}.run_debounced WHERE namespace = $1 AND run_id = $2
"""
