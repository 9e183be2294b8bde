"""Verbs, reply codes and the header fields of requests, replies and notifications.

Shared by the server and every client; PROTOCOL.md is the normative description.
Codes follow FTP's meaning: 1xx unsolicited/preliminary, 2xx success, 4xx refused
for now (may succeed later), 5xx refused for good.
"""

from __future__ import annotations

import re

# Verbs (header key "op").
PUT = "PUT"
APPEND = "APPEND"
GET = "GET"
PEEK = "PEEK"
LIST = "LIST"
DELETE = "DELETE"
LISTEN = "LISTEN"
UNLISTEN = "UNLISTEN"
NOOP = "NOOP"
AUTH = "AUTH"  # prove knowledge of the server's token (only where the greeting asks for it)

VERBS = frozenset({PUT, APPEND, GET, PEEK, LIST, DELETE, LISTEN, UNLISTEN, NOOP, AUTH})
VERBS_WITH_BIN = frozenset({PUT, APPEND, GET, PEEK, DELETE, LISTEN, UNLISTEN})
VERBS_WITH_VALUE = frozenset({PUT, APPEND})

# Reply codes (header key "code").
KEEPALIVE = 110  # unsolicited: the server checks that an idle, listening connection is alive
NOTIFY = 151  # unsolicited: a bin changed
OK = 200  # command okay
LIST_OK = 212  # bin listing follows
GREETING = 220  # service ready (sent once, on connect)
ITEMS = 226  # items follow in the payload
AUTHENTICATED = 230  # AUTH accepted; the reply proves that the server knows the token too
DONE = 250  # requested bin action completed
UNAVAILABLE = 421  # shutting down / too many connections
ZERO_COPY_REFUSED = 425  # a value named in shared memory was not taken: send it over TCP
LOCAL_ERROR = 451  # the server could not read what it stores (a disk error)
STORAGE_FULL = 452  # no room in the memory budget or on disk
BAD_FRAME = 500  # syntax error: malformed frame or header
BAD_ARGS = 501  # syntax error in parameters
UNKNOWN_VERB = 502  # command not implemented
BAD_SEQUENCE = 503  # AUTH when it is not expected (already authenticated, or the server has no token)
NOT_AUTHENTICATED = 530  # authentication required or failed; the server closes the connection
NO_SUCH_BIN = 550
TOO_LARGE = 552  # exceeded a size or count limit
BAD_NAME = 553  # bin name not allowed

# Same-host zero-copy (PROTOCOL.md §10): header keys.
SHM = "shm"  # greeting: the shared areas; PUT/APPEND: the item directory the value was written to
REF = "ref"  # GET/PEEK: area indexes the client can map; 226: "refs", one per item
REFS = "refs"
RELEASE = "release"  # any request: ids of 226 replies whose references the client no longer needs

PROTOCOL_VERSION = 1
TAG_MIN, TAG_MAX = -(1 << 63), (1 << 63) - 1  # an item's optional tag is a signed 64-bit integer
MAX_BIN_NAME = 256
_BIN_NAME = re.compile(r"[^\x00-\x1f\x7f]+")


def check_tag(tag: object) -> str | None:
    """Why ``tag`` is not a valid item tag (a signed 64-bit integer or None), or None."""
    if tag is None or (type(tag) is int and TAG_MIN <= tag <= TAG_MAX):
        return None
    return f"tag must be a 64-bit signed integer, not {tag!r:.40}"


def check_bin_name(name: object, max_len: int = MAX_BIN_NAME) -> str | None:
    """Why ``name`` is not a valid bin name, or None if it is.

    A bin name is a non-empty str of at most ``max_len`` characters with no control
    characters.  Names are data: the server never uses one as a path.
    """
    if not isinstance(name, str):
        return f"bin name must be a string, not {type(name).__name__}"
    if not name or len(name) > max_len:
        return f"bin name must have 1 to {max_len} characters"
    if not _BIN_NAME.fullmatch(name):
        return "bin name must not contain control characters"
    return None
