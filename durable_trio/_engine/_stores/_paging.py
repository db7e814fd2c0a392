"""Run paging: the opaque cursor of :meth:`RunStore.page_runs`, and its arguments checked.

Every store numbers its runs in creation order (``seq``: a counter, never a timestamp). A page
is "the newest runs with a ``seq`` below the cursor", so a run created while someone pages
gets a higher number and never shifts the pages that follow (an offset would). The cursor is
``"r1."`` followed by the URL-safe base64 of the ``seq`` in decimal: opaque to callers (they
only pass back what they got), versioned so its format can change.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import TYPE_CHECKING, Final

from ..._errors import ConfigError
from ..._logs import get_logger

if TYPE_CHECKING:
    from collections.abc import Sequence

    from .._records import DamagedRun, RunRecord

__all__ = ["MAX_PAGE", "check_page", "decode_cursor", "encode_cursor", "skip_damaged"]

log = get_logger("durable_trio.engine")

_PREFIX: Final = "r1."

#: The largest page a store returns in one call.
MAX_PAGE: Final = 1000


def encode_cursor(seq: int) -> str:
    """The cursor meaning "runs older than the one numbered ``seq``"."""
    return _PREFIX + base64.urlsafe_b64encode(str(seq).encode()).decode().rstrip("=")


def decode_cursor(cursor: str | None) -> int | None:
    """The ``seq`` a cursor stands for (``None``: no cursor, the first page).

    Raises:
        ConfigError: not a cursor a store returned.
    """
    if cursor is None:
        return None
    if not isinstance(cursor, str) or not cursor.startswith(_PREFIX):
        raise ConfigError(f"not a run list cursor: {cursor!r}")
    body = cursor[len(_PREFIX) :]
    try:
        text = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).decode("ascii")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise ConfigError(f"not a run list cursor: {cursor!r}") from None
    if not text.isdigit() or len(text) > 18:
        raise ConfigError(f"not a run list cursor: {cursor!r}")
    return int(text)


def check_page(
    limit: object, since: object = None, until: object = None, tenant: object = None
) -> None:
    """Check :meth:`RunStore.page_runs`'s arguments.

    Raises:
        ConfigError: ``limit`` is not an int in ``1..MAX_PAGE``, ``since`` / ``until`` not
            finite numbers, ``tenant`` empty or holding ``/``.
    """
    if type(limit) is not int or not 1 <= limit <= MAX_PAGE:
        raise ConfigError(f"limit is an integer from 1 to {MAX_PAGE}, got {limit!r}")
    for name, value in (("since", since), ("until", until)):
        if value is None:
            continue
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise ConfigError(f"{name} is a time in seconds (store clock), got {value!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant or "/" in tenant):
        raise ConfigError(f"a tenant is a non-empty name without '/', got {tenant!r}")


def skip_damaged(runs: list[RunRecord], damaged: Sequence[DamagedRun]) -> list[RunRecord]:
    """``runs``, each damaged row of the listing logged at WARNING: ``list_runs`` leaves them
    out (``page_runs``, the operators' listing, names them in :attr:`RunPage.damaged`)."""
    for entry in damaged:
        log.warning("%s: left out of the listing", entry.reason)
    return runs
