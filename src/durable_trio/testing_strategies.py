"""Moved to :mod:`durable_trio.testing.strategies`; this name keeps old imports working."""

from __future__ import annotations

from .testing.strategies import json_values, message_of

__all__ = ["json_values", "message_of"]
