"""Worker-key stores: short-lived keys with expiry (liveness, descriptors, registrations)."""

from __future__ import annotations

from ._contract import KeyEntry, KeyStore

__all__ = ["KeyEntry", "KeyStore"]
