"""Strings a client chooses that the server repeats: ``request_id``, ``tenant``
and ``cache_salt``.

Each is bounded on the way in (``check_client_string``: at most
``max_id_bytes`` UTF-8 bytes, printable characters only), so it cannot
multiply into every streamed message, fill the fair-share table, or forge a
log line with a newline. A client string that is refused, or that reaches
a message without having been checked (an Abort's id), goes out through
``quoted``: escaped and truncated.
"""

from __future__ import annotations

DEFAULT_MAX_ID_BYTES = 256
# Characters of a client string quoted in an error message or a log line.
QUOTED_CHARS = 64


def check_client_string(field: str, value: str, max_bytes: int = DEFAULT_MAX_ID_BYTES) -> None:
    """Raise ValueError naming ``field`` when ``value`` is longer than
    ``max_bytes`` in UTF-8 or holds a character that is not printable."""
    # A character is at most 4 bytes: a string past the limit in characters is
    # past it in bytes without encoding it.
    size = len(value) if len(value) > max_bytes else len(value.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ValueError(
            f"{field} is longer than max_id_bytes={max_bytes} bytes (the server's limit)"
        )
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"{field} holds a character that is not printable ({bad!r})")


def loggable(text: str, limit: int = DEFAULT_MAX_ID_BYTES) -> str:
    """``text`` as is when it is short and printable (an id the fronts let
    through), else ``quoted``: a log line cannot be forged or flooded with it."""
    return text if len(text) <= limit and text.isprintable() else quoted(text)


def quoted(text: str, limit: int = QUOTED_CHARS) -> str:
    """``text`` as a quoted, escaped literal of at most ``limit`` characters
    (newlines and control characters escaped), with its length when cut."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


def check_client_strings(
    request_id: str | None, options: dict, max_bytes: int = DEFAULT_MAX_ID_BYTES
) -> None:
    """``request_id`` (None: the server picked it) and the string Request
    options a client gave (tenant, cache_salt), each checked as above."""
    if request_id is not None:
        check_client_string("request_id", request_id, max_bytes)
    for name, value in options.items():
        if isinstance(value, str):
            check_client_string(name, value, max_bytes)
