"""What every broker that keeps fleet-wide concurrency limits (``SupportsQueueLimits``) shares:
the check of a limit and the key a job counts under."""

from __future__ import annotations

from .._errors import ConfigError

__all__ = ["check_limit", "key_of"]


def check_limit(limit: object) -> int | None:
    """``limit`` as a queue's concurrency limit: ``None`` or an int >= 1.

    Raises:
        ConfigError: anything else.
    """
    if limit is None or (type(limit) is int and limit >= 1):
        return limit
    raise ConfigError(f"a queue's concurrency limit is None or an int >= 1, got {limit!r}")


def key_of(key: str | None) -> str:
    """The key a job counts under on a per-key limited queue (no key: ``""``)."""
    return key or ""
