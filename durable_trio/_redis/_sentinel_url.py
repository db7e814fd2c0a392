"""Parsing ``redis+sentinel://`` / ``rediss+sentinel://`` URLs (see :func:`parse_sentinel_url`).

The form::

    redis+sentinel://[[user]:password@]s1[:port],s2[:port],.../MASTER_NAME[/DB][?option=value&...]

The user name and password are the data nodes' (the master's, and a replica's once promoted);
the sentinels' own password, if they have one, is the ``sentinel_password`` option.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import unquote

import attrs

from ._url import (
    _QUERY_KEYS,
    SENTINEL_SCHEMES,
    RedisURL,
    _credentials,
    _fault,
    _options,
    _seeds,
    _settings,
    _split,
)

__all__ = ["SENTINEL_SCHEMES", "SentinelURL", "parse_sentinel_url"]

#: The port of a sentinel named without one (Redis Sentinel's own default).
DEFAULT_SENTINEL_PORT: Final = 26379
_SENTINEL_KEYS: Final = _QUERY_KEYS | {"sentinel_password"}


@attrs.frozen
class SentinelURL:
    """A master found through sentinels, as parsed by :func:`parse_sentinel_url`.

    Attributes:
        sentinels: the sentinels' ``(host, port)``, in the URL's order.
        master_name: the name the sentinels monitor the master under.
        data: the data nodes' settings (database, credentials, TLS, client name); its host is
            a stand-in naming the master (its port 0) until the sentinels name the address.
        sentinel_password: the sentinels' ``requirepass``, or ``None``; never shown by ``repr``.
    """

    sentinels: tuple[tuple[str, int], ...]
    master_name: str
    data: RedisURL
    sentinel_password: str | None = attrs.field(default=None, repr=False)

    def master_url(self, host: str, port: int) -> RedisURL:
        """The data node settings for the master at ``host:port``.

        Args:
            host: the master's host, as a sentinel named it.
            port: its port.

        Returns:
            :attr:`data` with that address.
        """
        return attrs.evolve(self.data, host=host, port=port)

    def sentinel_url(self, index: int) -> RedisURL:
        """The settings to reach sentinel ``index`` (plain TCP, ``sentinel_password``).

        Args:
            index: its position in :attr:`sentinels`.

        Returns:
            settings with its address, password and the URL's client name (database 0).
        """
        host, port = self.sentinels[index]
        return RedisURL(
            host=host,
            port=port,
            password=self.sentinel_password,
            client_name=self.data.client_name,
        )


def _path(url: str, end: int) -> tuple[str, int]:
    """The master name and the database number of the path (``/NAME`` or ``/NAME/DB``)."""
    stops = [i for i in (url.find(mark, end) for mark in "?#") if i >= 0]
    segments = url[end : min(stops, default=len(url))].removeprefix("/").split("/")
    if segments[-1] == "" and len(segments) > 1:
        segments.pop()  # a trailing slash
    name = unquote(segments[0])
    if not name:
        raise _fault(end, "the path names the master, as the sentinels know it (/mymaster)")
    if len(segments) == 1:
        return name, 0
    at = end + 1 + len(segments[0]) + 1
    digits = segments[1]
    if len(segments) > 2 or not (digits.isascii() and digits.isdigit()):
        raise _fault(at, "after the master name, the path is a database number (/mymaster/0)")
    return name, int(digits)


def parse_sentinel_url(url: str) -> SentinelURL:
    """Parse ``redis[s]+sentinel://[[user]:password@]host[:port],.../MASTER_NAME[/DB][?...]``.

    Sentinels without a port are on 26379. User name and password (percent-encoded where
    they hold ``@ : / ? # %``) authenticate on the data nodes. Options: ``client_name``;
    ``sentinel_password`` (the sentinels' ``requirepass``, percent-encoded); with
    ``rediss+sentinel://`` (TLS to the data nodes; the sentinels are spoken to in plain TCP)
    ``ssl_cert_reqs`` and ``ssl_ca_certs`` as for ``rediss://``; ``min_replicas`` and
    ``replica_timeout`` as for ``redis://`` (on the data nodes). Anything else is refused.

    Error handling: a message names the position of the fault, never the text there.

    Args:
        url: the URL.

    Returns:
        the parsed settings.

    Raises:
        ConfigError: the URL is not of that form.
    """
    scheme, start, end, host_at = _split(url, "redis+sentinel", "a Sentinel URL")
    username, password = _credentials(url, start, host_at)
    sentinels = _seeds(url, host_at, end, DEFAULT_SENTINEL_PORT, "sentinel")
    name, db = _path(url, end)
    settings = _settings(
        url, start, end, scheme == "rediss+sentinel", username, password, _SENTINEL_KEYS
    )
    return SentinelURL(
        sentinels=tuple(sentinels),
        master_name=name,
        data=RedisURL(host=f"master {name!r} (via sentinels)", port=0, db=db, **settings),
        sentinel_password=_options(url, end, _SENTINEL_KEYS).get("sentinel_password") or None,
    )
