"""Moved to :mod:`durable_trio.testing.strategies`; this name keeps old imports working."""

from __future__ import annotations

from .testing.strategies import MESSAGE_TYPES, json_values, message_of, wire_messages

__all__ = ["MESSAGE_TYPES", "json_values", "message_of", "wire_messages"]
