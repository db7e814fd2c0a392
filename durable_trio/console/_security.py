"""The console's security model: who may read, who may act, and from where.

- **Exposure.** Listening on a loopback address needs no token; any other address does
  (:func:`check_exposure` refuses to start without one).
- **The token** is checked on every request, static files included, with a constant-time
  compare: an ``Authorization: Bearer TOKEN`` header, or the cookie set when a page is opened
  once as ``?token=TOKEN`` (the page is then redirected to the same address without it, so the
  token does not stay in the address bar or the history). That redirect goes only to a
  path of the console itself: an address a browser would read as another host
  (``//evil.example``, ``/\\evil.example``) is sent to ``/`` instead (no open redirect).
- **Malformed paths.** A path holding a control character (a CR or LF, percent-encoded) is
  answered 400 before anything else: it names no page, and could split a header.
- **DNS rebinding.** Without a token (loopback), a request whose ``Host`` is not a loopback
  name is refused: a page of another site that got its name pointed at 127.0.0.1 cannot read
  the console.
- **Actions** (retry, cancel, start a run, send a signal, cancel or retry the runs a filter
  matches (the count the page showed is checked again), pause, resume or delete a schedule,
  requeue or delete a set-aside job) are ``POST`` requests that must carry the
  ``X-Durable-Console: action`` header, which a page of another origin cannot send without a
  CORS preflight the console never answers; an ``Origin`` header, when sent, must name the
  console itself. They answer 403 unless the console was started with ``allow_actions``.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import unicodedata
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, quote, urlencode

from .._errors import ConfigError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

__all__ = [
    "ACTION_HEADER",
    "ACTION_HEADER_VALUE",
    "TOKEN_COOKIE",
    "TokenGuard",
    "check_exposure",
    "has_control",
    "is_loopback",
    "local_path",
    "same_origin",
]

#: The header every action request must carry (``fetch()`` sets it; a form post cannot).
ACTION_HEADER = "x-durable-console"
ACTION_HEADER_VALUE = "action"
#: The cookie that carries the token after ``?token=``.
TOKEN_COOKIE = "durable_console_token"

#: What a token may hold: enough to be hard to guess, and safe in a cookie and a header.
_TOKEN = re.compile(r"[A-Za-z0-9._~+/=-]{16,}")

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is loopback."""
    name = host.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Refuse a console that would listen beyond loopback without a token.

    Raises:
        ConfigError: ``host`` is not loopback and there is no token, or the token is empty
            or too short to guess at (under 16 characters), or holds a character a cookie
            cannot carry as it is.
    """
    if token is not None:
        if not _TOKEN.fullmatch(token):
            raise ConfigError(
                "the console token must be at least 16 characters of A-Z a-z 0-9 . _ ~ + / = -"
                " (e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)"
            )
        return
    if not is_loopback(host):
        raise ConfigError(
            f"the console listens on {host!r}, beyond loopback: give it a --token"
            " (or listen on 127.0.0.1)"
        )


def _host_of(header: str) -> str:
    """The host part of a ``Host`` header (``name:port``, ``[v6]:port``)."""
    if header.startswith("["):
        return header[: header.find("]") + 1] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def same_origin(origin: str, host: str) -> bool:
    """Whether an ``Origin`` header names the console that answers as ``Host: host``."""
    scheme, _, rest = origin.partition("://")
    return scheme in ("http", "https") and rest.lower() == host.lower()


def has_control(path: str) -> bool:
    """Whether a (decoded) request path holds a control character (CR, LF, NUL, ESC, DEL, a
    C1 control): no console page has one, and one must never reach a header."""
    return not path.isprintable() and any(unicodedata.category(c) == "Cc" for c in path)


def local_path(path: str) -> str:
    """``path`` (decoded) as a ``Location`` on this console: percent-encoded, and ``/``
    unless it is a path of this host (``//x`` and ``/\\x`` name other hosts to a browser,
    a path not starting with ``/`` is not ours)."""
    if not path.startswith("/") or path.startswith("//") or "\\" in path or has_control(path):
        return "/"
    return quote(path, safe="/-._~!$&'()*+,;=:@")


def _headers(scope: Scope) -> dict[str, str]:
    return {
        key.decode("latin-1").lower(): value.decode("latin-1")
        for key, value in scope.get("headers", [])
    }


def _cookie(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


class TokenGuard:
    """ASGI middleware: the token on every request, and loopback ``Host`` names without one."""

    def __init__(self, app: ASGIApp, *, token: str | None) -> None:
        self._app = app
        self._token = token.encode() if token is not None else None

    def _matches(self, candidate: str | None) -> bool:
        if self._token is None or candidate is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8", "replace"), self._token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        if has_control(scope.get("path", "")):
            await _plain(send, 400, "bad request: a control character in the path")
            return
        headers = _headers(scope)
        if self._token is None:
            if not is_loopback(_host_of(headers.get("host", "localhost"))):
                await _plain(send, 421, "this console answers only to a loopback host name")
                return
            await self._app(scope, receive, send)
            return
        query = scope.get("query_string", b"").decode("latin-1")
        pairs = parse_qsl(query, keep_blank_values=True)
        given = [value for key, value in pairs if key == "token"]
        if given:
            if not self._matches(given[-1]):
                await _plain(send, 401, "wrong token")
                return
            rest = urlencode([(key, value) for key, value in pairs if key != "token"])
            path = local_path(scope.get("root_path", "") + scope["path"])
            location = path + (f"?{rest}" if rest else "")
            await _redirect_setting_cookie(send, location, given[-1])
            return
        auth = headers.get("authorization", "")
        bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
        cookie = _cookie(headers.get("cookie", ""), TOKEN_COOKIE)
        if not (self._matches(bearer) or self._matches(cookie)):
            await _plain(send, 401, "a token is needed: open the console as /?token=TOKEN")
            return
        await self._app(scope, receive, send)


async def _plain(send: Send, status: int, text: str) -> None:
    body = (text + "\n").encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"text/plain; charset=utf-8"),
                (b"content-length", str(len(body)).encode()),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _redirect_setting_cookie(send: Send, location: str, token: str) -> None:
    cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict"
    await send(
        {
            "type": "http.response.start",
            "status": 303,
            "headers": [
                (b"location", location.encode("latin-1", "replace")),
                (b"set-cookie", cookie.encode("latin-1")),
                (b"content-length", b"0"),
                (b"cache-control", b"no-store"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": b""})
