"""The SQLite layer shared by the broker, the key store and the run store on one file.

:mod:`durable_trio.brokers.sqlite`, :mod:`durable_trio.keys.sqlite` and the engine's SQLite run
store reach the file through these parts, never through one another (as the Redis ones reach
the server through :mod:`durable_trio._redis`):

- ``_file.py``: what every connection does at open (WAL mode, ``busy_timeout``,
  ``synchronous``, incremental auto-vacuum on a new file) and the file's identity (device,
  inode, store stamp);
- ``_connection.py``: :class:`ConnectionThread`, the one thread that owns a connection and
  runs one transaction at a time for Trio, :func:`open_connection`, :func:`translate_error`;
- ``_doorbell.py``: :class:`Doorbell`, the cross-process wake-up (Unix datagram sockets
  beside the file).
"""

from ._connection import ConnectionThread, open_connection, translate_error
from ._doorbell import Doorbell, bells_folder
from ._file import META_TABLE, ReadOnly, Synchronous

__all__ = [
    "META_TABLE",
    "ConnectionThread",
    "Doorbell",
    "ReadOnly",
    "Synchronous",
    "bells_folder",
    "open_connection",
    "translate_error",
]
