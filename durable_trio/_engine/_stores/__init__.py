"""Run stores: the contract (:class:`RunStore`) and one implementation per backend family.

Which store a backend's engines use is the backend's choice, made where it was opened (see
:mod:`durable_trio.backends`): ``memory://`` -> :class:`~.memory.MemoryRunStore` (one per
namespace, held by the backend, so engines sharing an in-process backend share their runs),
``sqlite:///`` -> :class:`~.sqlite.SqliteRunStore` (tables in the same file, on the broker's
connection thread), ``redis://`` / ``rediss://`` -> :class:`~.redis.RedisRunStore` (on the
backend's Redis client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from ._contract import RunStore

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from .memory import MemoryRunStore

__all__ = ["MemoryRunStore", "RunStore", "RunStoreOpener", "open_run_store"]


class RunStoreOpener(Protocol):
    """What :func:`open_run_store` needs of a backend (:class:`~durable_trio.Backend` is one):
    the stores name it here, so they need not import the backends that sit above them."""

    def open_run_store(self, namespace: str) -> AbstractAsyncContextManager[RunStore]:
        """Open the run store of ``namespace``'s runs; close it on leaving."""
        ...


def open_run_store(
    backend: RunStoreOpener, namespace: str
) -> AbstractAsyncContextManager[RunStore]:
    """Open the run store of ``backend`` for ``namespace``'s runs; close it on leaving.

    Args:
        backend: from :func:`~durable_trio.open_backend` (or built by hand: see
            :class:`~durable_trio.Backend` for the run stores it then has); any object with
            an ``open_run_store(namespace)`` of its own (:class:`RunStoreOpener`).
        namespace: whose runs (engines use their transport namespace, by default the app name).

    Raises:
        BrokerError: the store could not be opened (its tables created, ...).
    """
    return backend.open_run_store(namespace)


if not TYPE_CHECKING:  # (hidden from mypy, which would accept any name past a __getattr__)

    def __getattr__(name: str) -> type[MemoryRunStore]:
        # imported on first use (PEP 562): a worker's backend needs no run store of its own
        if name == "MemoryRunStore":
            from .memory import MemoryRunStore

            return MemoryRunStore
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
