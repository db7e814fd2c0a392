"""Small HTML helpers for the console's pages: escaping, the page layout, times and durations.

Every value that comes from the store or the broker goes through :func:`esc` (or :func:`attr`
inside an attribute): a run input or an error message is shown, never interpreted. A value is
shown up to :data:`VALUE_LIMIT` characters (:func:`json_block` then links to the whole), so a
page stays small whatever the size of a run's input, output or error.
"""

from __future__ import annotations

import html
import math
import time
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import orjson

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "VALUE_LIMIT",
    "Html",
    "ago",
    "attr",
    "duration",
    "esc",
    "json_block",
    "page",
    "path_part",
    "query",
    "stamp",
    "status_badge",
    "table",
]


#: Below this a store time is not Unix time but a monotonic clock's (``memory://``): 1973.
_UNIX_FLOOR = 1e8

#: The most characters of one value a page shows (64 KiB): a longer input, output, error or
#: name is cut there, with a link to the whole where there is one (the raw JSON endpoints).
VALUE_LIMIT = 64 * 1024


class Html(str):
    """Markup already escaped: :func:`esc` leaves it as it is."""

    __slots__ = ()


def _clipped(text: str) -> tuple[str, int]:
    """``text`` cut at :data:`VALUE_LIMIT` characters, and how many were left out."""
    if len(text) <= VALUE_LIMIT:
        return text, 0
    return text[:VALUE_LIMIT], len(text) - VALUE_LIMIT


def esc(value: object) -> Html:
    """``value`` as text in HTML (markup passes through as it is), cut after
    :data:`VALUE_LIMIT` characters (saying how many more there are)."""
    if isinstance(value, Html):
        return value
    text, left_out = _clipped("" if value is None else str(value))
    shown = html.escape(text, quote=False)
    return Html(shown + (f" … ({left_out:,} more characters)" if left_out else ""))


def attr(value: object) -> str:
    """``value`` escaped for a double-quoted attribute."""
    return html.escape("" if value is None else str(value), quote=True)


def path_part(value: str) -> str:
    """``value`` as one segment of a path (``/`` escaped too)."""
    return quote(value, safe="")


def query(params: Mapping[str, str | None]) -> str:
    """``?a=1&b=2`` of the non-empty ``params`` (or ``""``)."""
    kept = [(key, value) for key, value in params.items() if value]
    return f"?{urlencode(kept)}" if kept else ""


def stamp(seconds: float | None) -> Html:
    """A wall-clock time in a ``<time>`` element, labelled with its zone (``2026-12-05
    15:30:00 UTC``: a reader in another zone does not guess), or an em dash."""
    if seconds is None:
        return Html("—")
    if seconds < _UNIX_FLOOR:  # a monotonic store clock (memory://, trio's): no wall time
        title = "the store's monotonic clock, in seconds"
        return Html(f'<time class="mono" title="{title}">t={seconds:.3f}</time>')
    try:
        moment = time.gmtime(seconds)
    except (OverflowError, ValueError, OSError):  # no time a calendar has (damaged): as stored
        return Html(f'<time class="mono" title="not a time">{seconds!r}</time>')
    text = time.strftime("%Y-%m-%d %H:%M:%S", moment)
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", moment)
    return Html(f'<time datetime="{iso}">{text} UTC</time>')


def duration(seconds: float | None) -> str:
    """``0.42 s``, ``3.1 s``, ``4 min 05 s``, ``2 h 03 min`` (or an em dash)."""
    if seconds is None:
        return "—"
    if not math.isfinite(seconds):  # from a time no calendar has (damaged): as computed
        return f"{seconds} s"
    if seconds < 0:
        seconds = 0.0
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def ago(seconds: float | None, now: float) -> str:
    """How long before ``now`` (same clock) ``seconds`` was: ``3.0 s ago``."""
    return "—" if seconds is None else f"{duration(now - seconds)} ago"


def status_badge(status: object) -> Html:
    """A status as a coloured badge (the class is the status's own name)."""
    text = str(getattr(status, "value", status))
    css = "".join(c for c in text.lower() if c.isalnum() or c == "_")
    return Html(f'<span class="badge badge-{css}">{esc(text)}</span>')


def json_block(value: Any, whole: str | None = None) -> Html:
    """A JSON value, indented, in a ``<pre>``: its first :data:`VALUE_LIMIT` characters, and
    then a line saying how much more there is, linking to ``whole`` (the raw JSON) if given."""
    try:
        text = orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        text = repr(value)
    shown, left_out = _clipped(text)
    block = f'<pre class="json">{html.escape(shown, quote=False)}</pre>'
    if left_out:
        link = f' <a href="{attr(whole)}">the whole value (JSON)</a>' if whole else ""
        block += (
            f'<p class="clipped">shown: the first {len(shown):,} of {len(text):,} characters'
            f"{link}</p>"
        )
    return Html(block)


def table(
    headers: Iterable[str], rows: Iterable[Iterable[object]], *, empty: str, css: str = ""
) -> Html:
    """A table; ``empty`` is said instead when there is no row."""
    body = "".join(
        "<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>" for row in rows
    )
    if not body:
        return Html(f'<p class="empty">{esc(empty)}</p>')
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    return Html(
        f'<table class="{attr(css)}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    )


_CURRENT = ' aria-current="page"'
_NAV = (
    ("runs", "/runs", "Runs"),
    ("schedules", "/schedules", "Schedules"),
    ("workers", "/workers", "Workers"),
    ("queues", "/queues", "Queues"),
)


def page(
    *,
    title: str,
    section: str,
    body: Html,
    namespace: str,
    allow_actions: bool,
    live: bool = True,
) -> Html:
    """A whole page: the header, the navigation and ``body`` in ``<main>``.

    ``live`` pages are refreshed by the script (see ``console.js``) while they are shown.
    """
    nav = "".join(
        f'<a href="{href}"{_CURRENT if key == section else ""}>{label}</a>'
        for key, href, label in _NAV
    )
    mode = "actions allowed" if allow_actions else "read-only"
    return Html(
        "<!doctype html>"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)} · durable_trio console</title>"
        '<link rel="stylesheet" href="/static/console.css">'
        '<script src="/static/console.js" defer></script>'
        "</head>"
        f'<body data-live="{"1" if live else "0"}" data-actions="{"1" if allow_actions else "0"}">'
        '<header><span class="brand">durable_trio</span>'
        f"<nav>{nav}</nav>"
        f'<span class="meta">namespace <b>{esc(namespace)}</b> · {mode}'
        ' · <span id="live-state">live</span></span></header>'
        f'<main id="main">{body}</main>'
        "</body></html>"
    )
