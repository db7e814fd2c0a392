"""Backend URLs as they may be shown: with any user name and password masked.

Every place that prints, logs, raises or stores a backend URL goes through :func:`redact_url`
(``Backend.url``, the command line, error messages), so a password written into a URL cannot
reach a terminal, a log or an error hook.
"""

from __future__ import annotations

import re
from typing import Final

__all__ = ["MASK", "redact_url", "url_scheme"]

#: What stands in for the ``user:password`` part of a shown URL.
MASK: Final = "***"

_SCHEME: Final = r"[A-Za-z][A-Za-z0-9+.-]*"  # (re caches it compiled, on first use)
#: A password given as a query option (``?sentinel_password=...``): its value, up to the next
#: ``&`` (not ``#``: an unencoded ``#`` in it must not end the mask early).
_QUERY_PASSWORD: Final = r"([?&][^=&?]*password=)[^&]*"


def url_scheme(url: str) -> str | None:
    """The scheme before ``://``, or ``None`` when ``url`` does not start with one.

    Unlike ``urlsplit(url).scheme`` this never mistakes a password for a scheme: in
    ``S3cret:pw@host`` (the ``redis://`` forgotten) ``urlsplit`` finds the scheme ``s3cret``.

    Args:
        url: any text.

    Returns:
        the scheme, lower case, or ``None``.
    """
    scheme, separator, _ = url.partition("://")
    if not separator or re.fullmatch(_SCHEME, scheme) is None:
        return None
    return scheme.lower()


def redact_url(url: str) -> str:
    """``url`` with everything between ``://`` and the LAST ``@`` replaced by ``***``.

    The last ``@`` rather than the end of the host part, so a password holding an unescaped
    ``/``, ``?``, ``#`` or ``@`` (which ends the host part early for a URL parser) is still
    masked whole; at worst an ``@`` in a path or query masks more than the credentials. A URL
    whose part after ``://`` starts with ``/`` has no host part (``sqlite:///file.db``) and is
    returned unchanged. The value of a query option named ``password`` or ``..._password``
    (``sentinel_password``) is masked too, first (an ``@`` in it does not move the other
    mask). Text that does not start with a scheme and ``://`` is not shown at all. Never
    raises.

    Args:
        url: a backend URL, well formed or not.

    Returns:
        the URL to show: ``redis://***@host:6379/0``, or ``***`` for text without a scheme.
        A query password shows as ``?sentinel_password=***``.
    """
    scheme = url_scheme(url)
    if scheme is None:
        return MASK
    shown, _, rest = url.partition("://")
    if rest.startswith("/"):
        return url
    rest = re.sub(_QUERY_PASSWORD, lambda found: found.group(1) + MASK, rest, flags=re.IGNORECASE)
    if "@" not in rest:
        return f"{shown}://{rest}"
    return f"{shown}://{MASK}@{rest.rpartition('@')[2]}"
