"""Parsing ``redis://`` / ``rediss://`` URLs into connection settings (and a TLS context)."""

from __future__ import annotations

import ssl
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

import attrs

from .._errors import ConfigError

__all__ = ["RedisURL", "parse_redis_url"]

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
_QUERY_KEYS = frozenset({"client_name", "ssl_cert_reqs", "ssl_ca_certs"})


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

    @property
    def address(self) -> str:
        """``host:port``, for messages (never includes credentials)."""
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


def parse_redis_url(url: str) -> RedisURL:
    """Parse ``redis[s]://[[user]:password@]host[:port][/db][?option=value&...]``.

    User name and password are percent-decoded. Options: ``client_name``, ``ssl_cert_reqs``
    (``none`` / ``optional`` / ``required``) and ``ssl_ca_certs`` (a file path); the ``ssl_``
    options need ``rediss://``. Anything else is refused, so a typo cannot pass silently.

    Args:
        url: the URL.

    Returns:
        the parsed settings.

    Raises:
        ConfigError: the URL is not one of the above.
    """
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"invalid Redis URL: {exc}") from exc
    if parts.scheme not in ("redis", "rediss"):
        raise ConfigError(f"a Redis URL starts with redis:// or rediss://, not {parts.scheme!r}")
    if not parts.hostname:
        raise ConfigError("a Redis URL needs a host")
    path = parts.path.strip("/")
    if not path:
        db = 0
    elif path.isdigit():
        db = int(path)
    else:
        raise ConfigError(f"the Redis URL path is a database number, not {parts.path!r}")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if username and password is None:
        raise ConfigError("a Redis URL with a user name needs a password (user:password@)")
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=False):
        if key not in _QUERY_KEYS:
            raise ConfigError(f"unknown Redis URL option {key!r} (known: {sorted(_QUERY_KEYS)})")
        query[key] = value
    tls = parts.scheme == "rediss"
    cert_reqs = _CERT_REQS_NAMES.get(query.get("ssl_cert_reqs", "required").lower())
    if cert_reqs is None:
        raise ConfigError(
            f"ssl_cert_reqs must be none, optional or required, not {query['ssl_cert_reqs']!r}"
        )
    if not tls and ("ssl_cert_reqs" in query or "ssl_ca_certs" in query):
        raise ConfigError("ssl_* options need a rediss:// URL")
    return RedisURL(
        host=parts.hostname,
        port=6379 if port is None else port,
        db=db,
        username=username,
        password=password,
        tls=tls,
        ssl_cert_reqs=cert_reqs,
        ssl_ca_certs=query.get("ssl_ca_certs") or None,
        client_name=query.get("client_name") or None,
    )
