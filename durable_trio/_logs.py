"""The package's loggers: a line they log never carries a terminal escape from stored data.

A log line names run ids, queue names, worker ids and error messages, written by whoever started
the run or ran the worker. Logged raw, an ``ESC`` sequence in one of them reaches the
operator's terminal through any handler that writes to it (``durable-trio worker``'s stderr,
``docker logs -f``, ``tail -f``). Every logger of this package is made by :func:`get_logger`,
with a filter that spells such characters out (:func:`~durable_trio._terminal.visible`) in the
message (a line break too: one record, one line) and in the exception's text (its line breaks
kept), for any handler the application configures. A structured ``extra`` field keeps its
value as it is (a JSON formatter escapes it).
"""

from __future__ import annotations

import logging
import time
import traceback
from typing import Final

from ._errors import BrokerError, BrokerUnavailable
from ._terminal import visible

__all__ = ["get_logger", "log_exception", "log_failure"]


class _Visible(logging.Filter):
    """Makes a record's message and exception text visible (never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format: logging reports it when a handler formats it
            return True
        if not message.isprintable():
            record.msg, record.args = visible(message), None
        exc_info = record.exc_info
        if exc_info and exc_info[1] is not None and not record.exc_text:
            text = _FORMATTER.formatException(exc_info)
            if not text.replace("\n", "").isprintable():
                # (line by line: the traceback's line breaks kept, and an error message's own
                # too, as PostgreSQL's multi-line ones; any other control character spelled
                # out). Only then: an ordinary traceback is left to the handler's formatter.
                record.exc_text = "\n".join(visible(line) for line in text.split("\n"))
        return True


_FORMATTER: Final = logging.Formatter()
_FILTER: Final = _Visible()


def get_logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)`` with the package's filter (added once per logger).

    Args:
        name: ``durable_trio`` or a name under it.

    Returns:
        the logger.
    """
    logger = logging.getLogger(name)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


def log_exception(
    logger: logging.Logger, level: int, exc: BaseException, context: str = ""
) -> None:
    """Log ``exc`` at ``level``: with its traceback where it was raised; as one line, its
    class's name and its message, where it was not (a finding reported, ``StepNotStarted``,
    ``DamagedJob``, ...: logging would otherwise print the message, then again its module's
    path, class and message, for a traceback of nothing).

    Args:
        logger: one of the package's loggers.
        level: ``logging.ERROR``, ``logging.WARNING``, ...
        exc: the error.
        context: what was being done, written before the error (``"Redis doorbell"``).
    """
    prefix = f"{context}: " if context else ""
    if exc.__traceback__ is None:
        logger.log(level, "%s%s: %s", prefix, type(exc).__name__, exc)
    else:
        logger.log(level, "%s%s", prefix, exc, exc_info=exc)


#: How long a broker error logged with its traceback is then logged in one line when the same
#: place meets it again (a damaged database, a refused script: every loop, every interval).
TRACEBACK_AGAIN_AFTER: Final = 600.0

#: How many such errors are remembered (all forgotten when it is reached: a traceback again).
_REMEMBERED: Final = 256

_shown: dict[tuple[str, str, str, str], float] = {}
"""(logger, class, where raised, message) -> when it was last logged with its traceback."""


def log_failure(
    logger: logging.Logger, level: int, exc: BaseException, context: str = ""
) -> None:
    """:func:`log_exception`, but a raised ``BrokerUnavailable`` (a store or broker down:
    refused, lost, timed out) in one line, naming the function that raised it
    (``... (in _listen_forever)``): whatever meets it meets it again and again through an
    outage, and its traceback (a chain of connect errors, tens of lines) says nothing its
    message does not. Any other raised ``BrokerError`` has its traceback the first time a
    place meets it, then, while the same place meets the same error again within
    :data:`TRACEBACK_AGAIN_AFTER` seconds, one line (a damaged SQLite file met by a loop every
    few seconds was a 20-line traceback each time, for as long as nobody repaired it). With
    ``logger`` at DEBUG every one has its traceback.

    Args:
        logger: one of the package's loggers.
        level: ``logging.ERROR``, ``logging.WARNING``, ...
        exc: the error.
        context: what was being done, written before the error (``"Redis doorbell"``).
    """
    if (
        isinstance(exc, BrokerError)
        and exc.__traceback__ is not None
        and not logger.isEnabledFor(logging.DEBUG)
    ):
        where = traceback.extract_tb(exc.__traceback__, limit=1)
        name = where[0].name if where else ""
        if not isinstance(exc, BrokerUnavailable) and not _shown_lately(logger, exc, name):
            log_exception(logger, level, exc, context)
            return
        within = f" (in {name})" if name else ""
        prefix = f"{context}: " if context else ""
        logger.log(level, "%s%s: %s%s", prefix, type(exc).__name__, exc, within)
        return
    log_exception(logger, level, exc, context)


def _shown_lately(logger: logging.Logger, exc: BaseException, where: str) -> bool:
    """Whether this error, raised there, was logged with its traceback lately (and note that
    it is now, when not)."""
    key = (logger.name, type(exc).__name__, where, str(exc))
    now = time.monotonic()
    shown = _shown.get(key)
    if shown is not None and now - shown < TRACEBACK_AGAIN_AFTER:
        return True
    if len(_shown) >= _REMEMBERED:
        _shown.clear()
    _shown[key] = now
    return False
