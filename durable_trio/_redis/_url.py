"""Parsing ``redis://`` / ``rediss://`` URLs into connection settings (and a TLS context)."""

from __future__ import annotations

import math
import ssl
from typing import Any, Final, Literal
from urllib.parse import unquote, unquote_plus, urlsplit

import attrs

from .._attrs_shared import shared_eq, shared_hash, shared_repr
from .._errors import ConfigError
from .._redact import url_scheme

__all__ = [
    "SENTINEL_SCHEMES",
    "RedisClusterURL",
    "RedisURL",
    "parse_redis_cluster_url",
    "parse_redis_url",
]

#: The schemes of a Sentinel URL: plain, or TLS to the data nodes (here, not in
#: ``_sentinel_url``, so that telling a Sentinel URL apart loads none of the Sentinel code).
SENTINEL_SCHEMES: Final = frozenset({"redis+sentinel", "rediss+sentinel"})

CertReqs = Literal["none", "optional", "required"]

_CERT_REQS: dict[str, ssl.VerifyMode] = {
    "none": ssl.CERT_NONE,
    "optional": ssl.CERT_OPTIONAL,
    "required": ssl.CERT_REQUIRED,
}
_CERT_REQS_NAMES: dict[str, CertReqs] = {
    "none": "none",
    "optional": "optional",
    "required": "required",
}
_QUERY_KEYS = frozenset(
    {"client_name", "ssl_cert_reqs", "ssl_ca_certs", "min_replicas", "replica_timeout"}
)
#: ``replica_timeout`` without one in the URL: seconds a write waits for its replicas.
DEFAULT_REPLICA_TIMEOUT = 1.0


@attrs.frozen
class RedisURL:
    """Where and how to connect, as parsed from a URL by :func:`parse_redis_url`.

    Attributes:
        host: host name or IP address.
        port: TCP port (default 6379).
        db: database number selected on every connection (default 0).
        username: ACL user name, or ``None`` (``AUTH password`` then authenticates as default).
        password: password, or ``None`` (no ``AUTH``); never shown by ``repr``.
        tls: whether to speak TLS (the ``rediss://`` scheme).
        ssl_cert_reqs: certificate checking for TLS: ``"required"`` (default, with host name
            check), ``"optional"`` or ``"none"`` (no verification at all).
        ssl_ca_certs: a CA bundle file to trust instead of the system's, or ``None``.
        client_name: a name applied with ``CLIENT SETNAME`` on every connection, or ``None``.
        min_replicas: how many replicas must hold a write before the call returns (``WAIT``
            after each request holding a write, see ``_replicas.py``); 0 (default): no wait.
        replica_timeout: seconds ``WAIT`` waits for them before the call fails with
            ``BrokerUnavailable``.
    """

    host: str
    port: int = 6379
    db: int = 0
    username: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    tls: bool = False
    ssl_cert_reqs: CertReqs = "required"
    ssl_ca_certs: str | None = None
    client_name: str | None = None
    min_replicas: int = 0
    replica_timeout: float = DEFAULT_REPLICA_TIMEOUT

    @property
    def address(self) -> str:
        """``host:port``, for messages (never includes credentials); just ``host`` for port 0
        (the stand-in of a Sentinel client before it found its master)."""
        if self.port == 0:
            return self.host
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def handshake(self) -> list[tuple[str, ...]]:
        """The commands every fresh connection runs first: ``AUTH``, ``SELECT``, ``SETNAME``.

        Returns:
            the commands, possibly none (a default database without credentials or name).
        """
        commands: list[tuple[str, ...]] = []
        if self.password is not None:
            if self.username:
                commands.append(("AUTH", self.username, self.password))
            else:
                commands.append(("AUTH", self.password))
        if self.db:
            commands.append(("SELECT", str(self.db)))
        if self.client_name is not None:
            commands.append(("CLIENT", "SETNAME", self.client_name))
        return commands

    def ssl_context(self) -> ssl.SSLContext:
        """Build the client TLS context for this URL (``ssl.create_default_context()`` based).

        Returns:
            a context verifying the server against the system CAs (or ``ssl_ca_certs``), with
            verification relaxed or disabled as ``ssl_cert_reqs`` says.

        Raises:
            ConfigError: ``ssl_ca_certs`` cannot be loaded.
        """
        try:
            context = ssl.create_default_context(cafile=self.ssl_ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load ssl_ca_certs={self.ssl_ca_certs!r}: {exc}") from exc
        if self.ssl_cert_reqs != "required":
            context.check_hostname = False
            context.verify_mode = _CERT_REQS[self.ssl_cert_reqs]
        return context


#: Why a URL with a special character in its password goes wrong, and the fix.
_ENCODE_HINT = (
    "a user name or password holding @ : / ? # % or a space must be percent-encoded: "
    "%40 %3A %2F %3F %23 %25 %20"
)


def _fault(index: int, problem: str, *, hint: bool = False) -> ConfigError:
    """A parse error that names the position of the fault (1-based), never the text there: the
    text near a fault in the host part is often a piece of the password, and a URL cut short by
    a stray ``#`` in its password has no ``@`` left to tell where the password ends."""
    message = f"invalid Redis URL: character {index + 1}: {problem}"
    return ConfigError(f"{message} ({_ENCODE_HINT})" if hint else message)


def _split(url: str, plain: str, what: str) -> tuple[str, int, int, int]:
    """The scheme of ``url`` (``plain`` or its TLS form: ``redis`` / ``rediss``, ...) and where
    its host part starts, ends, and has its host (see :func:`_host_part`).

    Raises:
        ConfigError: another scheme or none, or an ``@`` after the host part.
    """
    tls = plain.replace("redis", "rediss", 1)
    scheme = url_scheme(url)
    if scheme not in (plain, tls):
        shown = f", not {scheme}://" if scheme else ""
        raise ConfigError(f"{what} starts with {plain}:// or {tls}://{shown}")
    start, end, host = _host_part(url)
    if url.rfind("@") >= end:
        # An '@' after the host part: a '/', '?' or '#' in the password ended it early.
        raise _fault(end, "the host part ends here, before the last '@'", hint=True)
    return scheme, start, end, host


def _host_part(url: str) -> tuple[int, int, int]:
    """Where the host part (``netloc``) starts and ends, and where its host begins (after the
    last ``@`` in it), as :func:`urllib.parse.urlsplit` would cut it."""
    start = url.index("://") + 3
    ends = [i for i in (url.find(mark, start) for mark in "/?#") if i >= 0]
    end = min(ends, default=len(url))
    at = url.rfind("@", start, end)
    return start, end, start if at < 0 else at + 1


def _port_index(url: str, host: int, end: int) -> int:
    """Where the port of the host part starts (what ``urlsplit(...).port`` parses)."""
    close = url.find("]", host, end) if "[" in url[host:end] else host - 1
    colon = url.find(":", close + 1, end)
    return end if colon < 0 else colon + 1


def _unparsable(url: str, host: int, end: int) -> ConfigError:
    """The error for a host part that ``urlsplit`` refused: where, and what is wrong there."""
    port_at = _port_index(url, host, end)
    digits = url[port_at:end]
    if "[" in url[host:end] or "]" in url[host:end] or port_at == end:
        return _fault(host, "the host cannot be parsed", hint=True)
    if digits.isascii() and digits.isdigit():
        return _fault(port_at, "the port is out of range 0-65535")
    return _fault(port_at, "the port is not a number", hint=True)


def _options(url: str, end: int, known: frozenset[str] = _QUERY_KEYS) -> dict[str, str]:
    """The query options, each checked where it is (its position named if it is unknown)."""
    query_at = url.find("?", end)
    if query_at < 0:
        return {}
    stop = url.find("#", query_at)
    stop = len(url) if stop < 0 else stop
    options: dict[str, str] = {}
    index = query_at + 1
    for piece in url[query_at + 1 : stop].split("&"):
        key, _, value = piece.partition("=")
        if piece:
            key = unquote_plus(key)
            if key not in known:
                names = ", ".join(sorted(known))
                raise _fault(index, f"an unknown option (known: {names})")
            options[key] = unquote_plus(value)
        index += len(piece) + 1
    return options


def parse_redis_url(url: str) -> RedisURL:
    """Parse ``redis[s]://[[user]:password@]host[:port][/db][?option=value&...]``.

    User name and password are percent-decoded (they must be percent-encoded where they hold
    ``@ : / ? # %``). Options: ``client_name``, ``ssl_cert_reqs`` (``none`` / ``optional`` /
    ``required``) and ``ssl_ca_certs`` (a file path); the ``ssl_`` options need ``rediss://``.
    ``min_replicas`` (a whole number) and ``replica_timeout`` (seconds, default 1): each write
    returns only once that many replicas hold it (see ``_replicas.py``).
    Anything else is refused, so a typo cannot pass silently.

    Error handling: a message names the position of the fault ("character 17: the port is not
    a number"), never the text there nor the URL.

    Args:
        url: the URL.

    Returns:
        the parsed settings.

    Raises:
        ConfigError: the URL is not one of the above.
    """
    scheme, start, end, host = _split(url, "redis", "a Redis URL")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        # urllib's message quotes the host part (the password with it). Raised below, outside
        # this block: ``from None`` would hide it from tracebacks but keep it as __context__.
        unparsable = True
    else:
        unparsable = False
    if unparsable:
        raise _unparsable(url, host, end)
    if not parts.hostname:
        raise _fault(host, "no host", hint=host > start)
    db = _database(url, end, parts.path)
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return RedisURL(
        host=parts.hostname,
        port=6379 if port is None else port,
        db=db,
        **_settings(url, start, end, scheme == "rediss", username, password),
    )


def _database(url: str, end: int, path: str) -> int:
    """The database number of the URL's path (``/3``), or 0 without one."""
    path = path.strip("/")
    if not path:
        return 0
    if path.isascii() and path.isdigit():
        return int(path)
    raise _fault(end + 1, "the path is a database number (like /0)")


def _settings(
    url: str,
    start: int,
    end: int,
    tls: bool,
    username: str | None,
    password: str | None,
    known: frozenset[str] = _QUERY_KEYS,
) -> dict[str, Any]:
    """The settings every node URL shares: credentials, TLS and the query options, checked
    (``known``: the options the URL may have, those of a Sentinel URL being more)."""
    if username and password is None:
        raise _fault(start, "a user name needs a password (user:password@)")
    query = _options(url, end, known)
    cert_reqs = _CERT_REQS_NAMES.get(query.get("ssl_cert_reqs", "required").lower())
    if cert_reqs is None:
        raise ConfigError("ssl_cert_reqs must be none, optional or required")
    if not tls and ("ssl_cert_reqs" in query or "ssl_ca_certs" in query):
        raise ConfigError(
            "ssl_* options need a rediss:// (or rediss+cluster://, rediss+sentinel://) URL"
        )
    return {
        "username": username,
        "password": password,
        "tls": tls,
        "ssl_cert_reqs": cert_reqs,
        "ssl_ca_certs": query.get("ssl_ca_certs") or None,
        "client_name": query.get("client_name") or None,
        **_replica_settings(query),
    }


def _replica_settings(query: dict[str, str]) -> dict[str, Any]:
    """``min_replicas`` (a whole number, 0 or more) and ``replica_timeout`` (positive seconds),
    checked (the values are not echoed: a message never quotes the URL)."""
    replicas = query.get("min_replicas", "0")
    if not (replicas.isascii() and replicas.isdigit()):
        raise ConfigError("min_replicas must be a whole number, 0 or more (min_replicas=1)")
    try:
        timeout = float(query.get("replica_timeout", DEFAULT_REPLICA_TIMEOUT))
    except ValueError:
        timeout = math.nan
    if not 0 < timeout < math.inf:
        raise ConfigError("replica_timeout must be a positive number of seconds")
    return {"min_replicas": int(replicas), "replica_timeout": timeout}


@attrs.frozen(repr=False, eq=False)
class RedisClusterURL:
    """A Redis Cluster's seed nodes and the settings of every node, from
    :func:`parse_redis_cluster_url`.

    Attributes:
        seeds: one :class:`RedisURL` per seed node, in the URL's order, each with the shared
            settings (credentials, TLS, client name; database 0: a Cluster has no other).
    """

    __repr__ = shared_repr
    __eq__ = shared_eq
    __hash__ = shared_hash

    seeds: tuple[RedisURL, ...]

    @property
    def address(self) -> str:
        """The seeds' ``host:port``, comma separated (never includes credentials)."""
        return ",".join(seed.address for seed in self.seeds)

    def node(self, host: str, port: int) -> RedisURL:
        """The settings for a node the cluster named (the seeds' credentials and TLS)."""
        return attrs.evolve(self.seeds[0], host=host, port=port)


def parse_redis_cluster_url(url: str) -> RedisClusterURL:
    """Parse ``redis+cluster://[[user]:password@]host1[:port1],host2[:port2]/[?option=value]``.

    ``rediss+cluster://`` speaks TLS. The seeds are only where to read the slot map first; the
    cluster names the other nodes. User name, password and options (``min_replicas`` too: each
    master waits for its own replicas) are those of :func:`parse_redis_url` and apply to every
    node; the path may only be empty or ``/0``
    (a Cluster has one database).

    Error handling: as :func:`parse_redis_url`, a message names the position of the fault, never
    the text there nor the URL.

    Args:
        url: the URL.

    Returns:
        the parsed seeds.

    Raises:
        ConfigError: the URL is not one of the above.
    """
    scheme, start, end, host_at = _split(url, "redis+cluster", "a Redis Cluster URL")
    username, password = _credentials(url, start, host_at)
    seeds = _seeds(url, host_at, end)
    if _database(url, end, urlsplit(f"redis://seed{url[end:]}").path) != 0:
        raise _fault(end + 1, "a Redis Cluster has only database 0 (no path, or /0)")
    settings = _settings(url, start, end, scheme == "rediss+cluster", username, password)
    return RedisClusterURL(
        seeds=tuple(RedisURL(host=host, port=port, **settings) for host, port in seeds)
    )


def _credentials(url: str, start: int, host_at: int) -> tuple[str | None, str | None]:
    """The user name and password before the hosts (``user:password@``), percent-decoded."""
    try:
        # The credentials alone, behind a placeholder host (the hosts are parsed one by one).
        credentials = urlsplit(f"redis://{url[start:host_at]}seed")
        username = unquote(credentials.username) if credentials.username else None
        password = unquote(credentials.password) if credentials.password is not None else None
    except ValueError:
        unparsable = True  # (raised outside the block: urllib's message quotes the password)
    else:
        unparsable = False
    if unparsable:
        raise _fault(start, "the user name or password cannot be parsed", hint=True)
    return username, password


def _seeds(
    url: str, host_at: int, end: int, default_port: int = 6379, noun: str = "seed"
) -> list[tuple[str, int]]:
    """The comma-separated ``host[:port]`` list between ``host_at`` and ``end`` of ``url``
    (cluster seeds, or sentinels: ``noun`` names them in messages)."""
    seeds: list[tuple[str, int]] = []
    index = host_at
    for piece in url[host_at:end].split(","):
        seeds.append(_seed(url, index, index + len(piece), default_port, noun))
        index += len(piece) + 1
    return seeds


def _seed(
    url: str, begin: int, end: int, default_port: int = 6379, noun: str = "seed"
) -> tuple[str, int]:
    """The ``host[:port]`` of one seed (or sentinel), between ``begin`` and ``end`` of
    ``url``."""
    if begin == end:
        raise _fault(begin, f"an empty {noun} ({noun}s are host:port,host:port)")
    try:
        parts = urlsplit(f"redis://{url[begin:end]}")
        port = parts.port
    except ValueError:
        unparsable = True
    else:
        unparsable = False
    if unparsable or "@" in url[begin:end]:
        raise _unparsable(url, begin, end)
    if not parts.hostname:
        raise _fault(begin, "no host")
    return parts.hostname, default_port if port is None else port
