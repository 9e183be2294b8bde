"""The protocol's messages, declared once for both ends (PROTOCOL.md §4-§6, §8, §10).

PROTOCOL.md is the normative text; this module is its machine-readable half, in
the manner of Twisted AMP's ``Command``.  Every verb is a :class:`Command` that
declares its request fields, the code and fields of its success reply, whether the
request carries a value payload, and which reply field is its result.  The server
checks requests with :meth:`Command.parse_request` (the checks of PROTOCOL.md §4.2,
in order) and answers with :meth:`Command.reply`; the clients check their
arguments with :meth:`Command.check_arguments`, build requests with
:meth:`Command.request` and check replies with :meth:`Command.check_reply`.  Frames
nobody asked for (the greeting, notifications, keepalives) and error replies are
:class:`Message` declarations.  Torch-free: the server imports it.

Adding a verb: declare it here, handle it in ``server/protocol/handlers.py``, and
give the clients a method in ``tensorshare/_client/methods.py``.

Codes follow FTP's meaning: 1xx unsolicited/preliminary, 2xx success, 4xx refused
for now (may succeed later), 5xx refused for good.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ProtocolError, RemoteError, UsageError, error_for_code

PROTOCOL_VERSION = 1


class Key:
    """Every header key, by name (PROTOCOL.md §4.1)."""

    OP, ID, CODE, MSG = "op", "id", "code", "msg"
    BIN, TAG, VALUE = "bin", "tag", "value"
    N, SEQ, EXISTS, BINS = "n", "seq", "exists", "bins"
    ITEMS, SIZES = "items", "sizes"
    SERVER, VERSION = "server", "version"
    MAX_FRAME = "max_frame"  # the greeting: the largest request payload the server reads (§7)
    AUTH, MECH, NONCE, PROOF = "auth", "mech", "nonce", "proof"
    # Same-host zero-copy (§10): the greeting's offer; a PUT/APPEND's item directory
    # and size; a GET/PEEK's mappable areas; a 226's references; released replies.
    SHM, SIZE, REF, REFS, RELEASE = "shm", "size", "ref", "refs", "release"
    # LISTEN: skip APPENDs to a bin that already holds items (§5)
    FIRST_APPEND = "first_append"
    # GET: take at most this many items; APPEND: only while the bin holds fewer than
    # ``below`` items, waiting up to ``wait`` seconds for room (§4.4)
    MAX, BELOW, WAIT = "max", "below", "wait"
    # GET with wait: held until the bin holds ``least`` items; PEEK with wait: held
    # while the bin is still at seq ``since`` (§4.5: reads that wait)
    LEAST, SINCE = "least", "since"
    # PUT: the bin lives only as long as this connection (§4.6: presence, membership);
    # PUT/DELETE: which of the connection's clients owns it (a relay's, §4.6)
    EPHEMERAL, OWNER = "ephemeral", "owner"
    # GET/PEEK: the reply lists every item's tag; LIST: a relay's state (§11)
    TAGS, RELAY = "tags", "relay"
    # PEEK (to a relay): push later copies of the bin as they arrive; an INCOMING
    # notification carrying one names the upstream change it is (§11)
    INCOMING, CHANGE = "incoming", "change"
    # CUDA IPC on one host (§13): a PUT's device reference, or the reference whose
    # bytes it brings; a PEEK's devices and a 226's references; a reply's freed references
    CUDA, FILL, FREED = "cuda", "fill", "freed"
    # the greeting of a worker of a multi-worker server: the map of its workers (§14)
    WORKERS = "workers"
    # PUT/APPEND reply to a same-host client: the bin is read by reference here (§10.4)
    MAPPED = "mapped"


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
WRONG_WORKER = 427  # another worker of this server owns the bin: map the workers again (§14)
BUSY = 450  # what the request waits for (room in a bin...) did not come within its wait
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

TAG_MIN, TAG_MAX = -(1 << 63), (1 << 63) - 1  # an item's optional tag is a signed 64-bit integer
ID_MAX = (1 << 64) - 1
MAX_BIN_NAME = 256
MAX_REPLY_HEADER = 256 << 20  # the largest reply header a client decodes (a server sends no larger)
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


# ------------------------------------------------------------------ field kinds


@dataclass(frozen=True)
class Kind:
    """What a field's value must be: ``problem(key, value, max_bin_name)`` says why
    a value is not one (None if it is); ``accepts(value)`` is the quick yes."""

    name: str
    problem: Callable[[str, Any, int], str | None]
    accepts: Callable[[Any], bool]


_ABSENT = object()


def _kind(name: str, accepts: Callable[[Any], bool]) -> Kind:
    def problem(key: str, value: Any, _max_bin_name: int) -> str | None:
        return None if accepts(value) else f"{key} must be {name}, not {value!r:.40}"
    return Kind(name, problem, accepts)


def _checked_kind(name: str, problem: Callable[[Any], str | None]) -> Kind:
    return Kind(name, lambda key, value, limit: problem(value), lambda value: problem(value) is None)


def _all_ints(value: Any) -> bool:
    return type(value) is list and all(type(v) is int for v in value)


def _counts(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str and type(v) is int for k, v in value.items())


INT = _kind("an integer", lambda v: type(v) is int)
BOOL = _kind("a boolean", lambda v: type(v) is bool)
STR = _kind("a string", lambda v: type(v) is str)
BYTES = _kind("bytes", lambda v: type(v) is bytes)
INTS = _kind("a list of integers", _all_ints)
LIST = _kind("a list", lambda v: type(v) is list)
COUNTS = _kind("a map of strings to integers", _counts)
MAP = _kind("a map", lambda v: type(v) is dict)
ANY = _kind("anything", lambda value: True)
TAG = _checked_kind("a tag", check_tag)
BIN_NAME = Kind("a bin name", lambda key, value, limit: check_bin_name(value, limit),
                lambda value: check_bin_name(value) is None)
TAGS = _kind("a list of tags", lambda v: type(v) is list and all(check_tag(t) is None for t in v))
_A_LIST = LIST  # (the name LIST is the verb's further down)
COUNT = _kind("an integer of at least 1", lambda v: type(v) is int and v >= 1)
MAX_WAIT = 86400.0  # seconds a request may ask the server to hold it
SECONDS = _kind(f"a number of seconds, 0 to {MAX_WAIT:g}",
                lambda v: type(v) in (int, float) and 0 <= v <= MAX_WAIT)


@dataclass(frozen=True)
class Field:
    """One header field: its key, its kind, whether it must be present, and the
    reply code a request gets when it is wrong (501 unless said otherwise)."""

    key: str
    kind: Kind
    required: bool = True
    code: int = BAD_ARGS
    missing: str | None = None  # the refusal's text when a required field is absent

    def problem(self, header: dict, max_bin_name: int = MAX_BIN_NAME) -> str | None:
        """Why ``header`` does not hold this field right (None if it does)."""
        if self.key not in header:
            return (self.missing or f"missing {self.key}") if self.required else None
        value = header[self.key]
        if value is None and not self.required:
            return None
        return self.kind.problem(self.key, value, max_bin_name)


def optional(key: str, kind: Kind, **kw) -> Field:
    return Field(key, kind, required=False, **kw)


BIN = Field(Key.BIN, BIN_NAME, code=BAD_NAME)
RELEASE = optional(Key.RELEASE, INTS)  # any request may carry it (§10.3)
# Release ids a client puts in one request: small ids are 1-3 bytes on the wire and
# 28 as objects, so a long list alone would pass the server's header_memory rule
# (PROTOCOL.md §7) and the request would be refused; 64 keep any header within it.
MAX_RELEASE_IDS = 64


class Request:
    """A checked request, as handlers receive it: ``id``, the command, the payload
    (as the receiver's sink made it) and one attribute per declared field (None
    when an optional field was absent).  Each :class:`Command` has its own
    subclass with slots for its fields."""

    __slots__ = ("command", "id", "payload", "payload_len")

    def __repr__(self) -> str:
        fields = ", ".join(f"{f.key}={getattr(self, f.key)!r:.40}" for f in self.command.fields)
        return f"<{self.command.verb} id={self.id} {fields}>"


class Message:
    """A header whose fields are declared: a reply, or a frame nobody asked for."""

    def __init__(self, code: int, fields: tuple[Field, ...] = ()):
        self.code = code
        self.fields = fields
        # The usual case, checked without building messages: (key, required, kind).
        self._fast = tuple((f.key, f.required, f.kind) for f in fields)

    def build(self, rid: int = 0, **fields) -> dict:
        """The header of this message (for request ``rid``; 0: unsolicited)."""
        if not fields:
            return {Key.CODE: self.code, Key.ID: rid}
        header = {Key.CODE: self.code, Key.ID: rid}
        header.update(fields)
        return header

    def check(self, header: dict) -> dict:
        """``header``, once it is found to hold every declared field right;
        :class:`ProtocolError` otherwise (the peer broke the protocol)."""
        for key, required, kind in self._fast:
            value = header.get(key, _ABSENT)
            if value is _ABSENT or value is None:
                if required:
                    break
                continue
            if not kind.accepts(value):
                break
        else:
            return header
        for field in self.fields:
            problem = field.problem(header)
            if problem is not None:
                raise ProtocolError(f"{self.code} reply: {problem}")
        return header


class Command:
    """A verb: its request fields, its success reply, its payload and its result.

    ``result`` names the reply field a client returns by default (None: nothing);
    ``payload`` says whether the request carries a value payload (PUT, APPEND).
    """

    def __init__(self, verb: str, fields: tuple[Field, ...] = (), *, reply: Message, payload: bool = False,
                 result: str | None = None, doc: str = ""):
        self.verb = verb
        self.fields = fields
        self.success = reply
        self.reply = reply.build  # reply(rid, **fields): the success reply header to request ``rid``
        self.payload = payload
        self.result = result
        self.doc = doc
        self.takes_bin = any(field.key == Key.BIN for field in fields)
        # parse_request's usual case, every field right: (key, required, accepts).
        self._fast = tuple((f.key, f.required, f.kind.accepts) for f in fields)
        slots = tuple(field.key for field in fields)
        self.Request = type(f"{verb.title()}Request", (Request,), {"__slots__": slots})
        self._slots = slots

    def __repr__(self) -> str:
        return f"<Command {self.verb}>"

    # -- the client's side

    def check_arguments(self, fields: dict) -> None:
        """Raise :class:`UsageError` for an argument the server would refuse (a bad
        bin name or tag), before anything is sent."""
        for field in self.fields:
            if field.key in fields:
                problem = field.problem(fields)
                if problem is not None:
                    raise UsageError(problem)

    def request(self, rid: int, fields: dict | None = None) -> dict:
        """The request header: ``op``, ``id`` and the given fields."""
        header = {Key.OP: self.verb, Key.ID: rid}
        if fields:
            header.update(fields)
        return header

    def check_reply(self, header: dict) -> dict:
        """The reply ``header`` if it is this command's success; the
        :class:`RemoteError` of an error reply is raised, and anything else
        (another code, a missing or ill-typed field) is a :class:`ProtocolError`."""
        code = header.get(Key.CODE)
        if code == self.success.code:
            return self.success.check(header)
        raise reply_error(header, f"{self.verb} reply")

    # -- the server's side

    def parse_request(self, header: dict, rid: int, payload: Any, payload_len: int,
                      max_bin_name: int = MAX_BIN_NAME) -> Request:
        """The typed request in ``header`` (whose ``op`` and ``id`` were checked);
        raises the :class:`RemoteError` to answer with (PROTOCOL.md §4.2, steps 3-5)."""
        if payload_len and not self.payload:
            raise error_for_code(BAD_ARGS, f"{self.verb} takes no payload")
        request = self.Request()
        request.command, request.id, request.payload, request.payload_len = self, rid, payload, payload_len
        if max_bin_name == MAX_BIN_NAME:  # (the fast test of a bin name assumes the default limit)
            for key, required, accepts in self._fast:
                value = header.get(key)
                if value is None:
                    if required:
                        break
                elif not accepts(value):
                    break
                setattr(request, key, value)
            else:
                return request
        for field in self.fields:  # find what is wrong, and say it
            problem = field.problem(header, max_bin_name)
            if problem is not None:
                raise error_for_code(field.code, problem)
            setattr(request, field.key, header.get(field.key))
        return request



def reply_error(header: dict, what: str) -> TensorShareErrorLike:
    """The exception for a reply that is not the success expected: the
    :class:`RemoteError` of an error code, else a :class:`ProtocolError`."""
    code = header.get(Key.CODE)
    if type(code) is not int:
        return ProtocolError(f"{what} without a code: {header!r:.200}")
    if code >= 400:
        return error_for_code(code, str(header.get(Key.MSG, "")))
    return ProtocolError(f"unexpected {what} code {code}: {header!r:.200}")


TensorShareErrorLike = ProtocolError | RemoteError


# ------------------------------------------------------------------ the verbs

_FREED = optional(Key.FREED, INTS)  # a publisher's device references no item holds any more (§13.3)
_CHANGED = Message(DONE, (Field(Key.N, INT), Field(Key.SEQ, INT), _FREED))
_DONE = Message(OK, (_FREED,))
_STORED = Message(DONE, (*_CHANGED.fields, optional(Key.MAPPED, BOOL)))
_ITEMS = Message(ITEMS, (Field(Key.SEQ, INT), Field(Key.ITEMS, LIST), Field(Key.SIZES, LIST),
                         optional(Key.REFS, LIST), optional(Key.TAGS, TAGS), optional(Key.CUDA, LIST)))
_STORE_FIELDS = (
    BIN,
    Field(Key.VALUE, BYTES, missing="missing value description"),
    optional(Key.TAG, TAG),
    optional(Key.SHM, ANY),  # the item directory a same-host client wrote (§10.4)
    optional(Key.SIZE, INT),
    RELEASE,
)
_READ_FIELDS = (BIN, optional(Key.REF, INTS), RELEASE, optional(Key.TAGS, BOOL))

OWNER = optional(Key.OWNER, _kind("bytes of at most 64", lambda v: type(v) is bytes and len(v) <= 64))
PUT = Command("PUT", (*_STORE_FIELDS, optional(Key.EPHEMERAL, BOOL), OWNER, optional(Key.CUDA, MAP),
                      optional(Key.FILL, INT)),
              reply=_STORED, payload=True, result=Key.N,
              doc="replace the bin's items with one item (ephemeral: for as long as this connection lasts; "
                  "cuda: by reference to the client's device memory; fill: that item's bytes)")
APPEND = Command("APPEND", (*_STORE_FIELDS, optional(Key.BELOW, COUNT), optional(Key.WAIT, SECONDS)),
                 reply=_STORED, payload=True, result=Key.N,
                 doc="add one item at the end of the bin (with below: once it holds fewer items)")
GET = Command("GET", (*_READ_FIELDS, optional(Key.MAX, COUNT), optional(Key.WAIT, SECONDS),
                     optional(Key.LEAST, COUNT)), reply=_ITEMS, result=Key.ITEMS,
              doc="take the bin's items (at most max of them) out of it (with wait: once it holds least)")
PEEK = Command("PEEK", (*_READ_FIELDS, optional(Key.WAIT, SECONDS), optional(Key.SINCE, INT),
                       optional(Key.INCOMING, BOOL), optional(Key.CUDA, LIST)), reply=_ITEMS, result=Key.ITEMS,
               doc="read every item of the bin (with wait: once its seq is no longer since; "
                   "cuda: device references where this client can open them)")
LIST = Command("LIST", (RELEASE,), reply=Message(LIST_OK, (Field(Key.BINS, COUNTS), optional(Key.RELAY, MAP))),
               result=Key.BINS,
               doc="every bin and its item count")
DELETE = Command("DELETE", (BIN, RELEASE, OWNER), reply=_CHANGED,
                 doc="remove the bin and its items (with owner: only while that owns the ephemeral bin)")
LISTEN = Command("LISTEN", (BIN, optional(Key.FIRST_APPEND, BOOL), RELEASE),
                 reply=Message(OK, (Field(Key.EXISTS, BOOL), Field(Key.N, INT), Field(Key.SEQ, INT),
                                    Field(Key.TAG, TAG))),
                 doc="notify this connection of the bin's changes; the reply is a snapshot")
UNLISTEN = Command("UNLISTEN", (BIN, RELEASE), reply=_DONE, doc="stop notifying this connection")
NOOP = Command("NOOP", (RELEASE,), reply=_DONE, doc="nothing: liveness and round-trip timing")
AUTH = Command("AUTH", (Field(Key.MECH, STR), Field(Key.NONCE, BYTES), Field(Key.PROOF, BYTES)),
               reply=Message(AUTHENTICATED, (Field(Key.PROOF, BYTES), optional(Key.SHM, MAP))),
               doc="prove knowledge of the server's token (§8.4)")

# -- tables (§12): a table is a kind of bin; its verbs start with T.
# Keys, indices, priorities and probabilities travel as little-endian int64/float64
# byte strings (one per row): 8 bytes a row, nothing to pack or check per element.

class TableKey:
    """The header keys of the table verbs (PROTOCOL.md §12)."""

    SPEC, INFO, LIMITS = "spec", "info", "limits"
    KEYS, INDICES, PRIORITIES, PROBABILITIES = "keys", "indices", "priorities", "probabilities"
    COLUMNS = "columns"  # a rows reply: its one item is the stacked columns (else: one item per row)
    TENSORDICT = "tensordict"  # rows came as a TensorDict: a client gives them back as one
    ADD_COLUMNS = "add_columns"  # TCREATE: a table there that lacks some of the columns gains them
    SAMPLE = "sample"  # TREAD: the rows were drawn by the reader: count (and rate-limit) them as a sample
    SLOTS = "slots"  # TINFO: the occupied slots from this index on (a page of them)


_TK = TableKey
_TABLE_CHANGED = Message(DONE, (Field(Key.N, INT), Field(Key.SEQ, INT), Field(_TK.KEYS, BYTES)))
_ROWS = Message(ITEMS, (*_ITEMS.fields, Field(_TK.KEYS, BYTES), Field(_TK.INDICES, BYTES), optional(_TK.PROBABILITIES, BYTES),
                        optional(_TK.COLUMNS, BOOL), optional(_TK.TENSORDICT, BOOL)))
_TABLE_INFO = Message(OK, (Field(_TK.INFO, MAP),))
_TABLE_VALUE = (Field(Key.VALUE, BYTES, missing="missing value description"),)

TCREATE = Command("TCREATE", (BIN, Field(_TK.SPEC, MAP), optional(_TK.ADD_COLUMNS, BOOL), RELEASE),
                  reply=_CHANGED, result=Key.N,
                  doc="make a table (kept as it is if one with the same settings exists)")
TINSERT = Command("TINSERT", (BIN, *_TABLE_VALUE, optional(_TK.PRIORITIES, BYTES), optional(Key.WAIT, SECONDS),
                              optional(_TK.TENSORDICT, BOOL), RELEASE),
                  reply=_TABLE_CHANGED, payload=True, result=_TK.KEYS,
                  doc="add rows (waiting up to wait seconds for the rate limiter)")
TWRITE = Command("TWRITE", (BIN, *_TABLE_VALUE, Field(_TK.INDICES, BYTES), optional(_TK.PRIORITIES, BYTES),
                            optional(_TK.TENSORDICT, BOOL), RELEASE),
                 reply=_TABLE_CHANGED, payload=True, result=_TK.KEYS, doc="put rows at the slot indices given")
TSAMPLE = Command("TSAMPLE", (BIN, Field(Key.N, COUNT), optional(Key.WAIT, SECONDS), optional(Key.REF, INTS), RELEASE),
                  reply=_ROWS,
                  result=Key.ITEMS, doc="draw n rows with the table's sampler (waiting up to wait seconds)")
TREAD = Command("TREAD", (BIN, Field(_TK.INDICES, BYTES), optional(Key.REF, INTS), optional(_TK.SAMPLE, BOOL),
                          optional(Key.WAIT, SECONDS), RELEASE), reply=_ROWS, result=Key.ITEMS,
                doc="read the rows at the slot indices given (with sample: as a sample the reader drew)")
TPRIORITY = Command("TPRIORITY", (BIN, Field(_TK.KEYS, BYTES), Field(_TK.PRIORITIES, BYTES), RELEASE),
                    reply=Message(OK, (Field(Key.N, INT),)), result=Key.N,
                    doc="set the priorities of the rows with these keys")
TINFO = Command("TINFO", (BIN, optional(_TK.SLOTS, INT), RELEASE), reply=_TABLE_INFO, result=_TK.INFO,
                doc="the table's settings, counters and rate-limiter state (with slots: its occupied slots)")
TLIMITS = Command("TLIMITS", (BIN, Field(_TK.LIMITS, MAP), RELEASE), reply=_TABLE_INFO, result=_TK.INFO,
                  doc="change the table's rate limits now")
TABLE_COMMANDS = (TCREATE, TINSERT, TWRITE, TSAMPLE, TREAD, TPRIORITY, TINFO, TLIMITS)

COMMANDS: dict[str, Command] = {c.verb: c for c in (PUT, APPEND, GET, PEEK, LIST, DELETE, LISTEN, UNLISTEN,
                                                    NOOP, AUTH, *TABLE_COMMANDS)}
VERBS = frozenset(COMMANDS)
VERBS_WITH_BIN = frozenset(verb for verb, c in COMMANDS.items() if c.takes_bin)
VERBS_WITH_VALUE = frozenset(verb for verb, c in COMMANDS.items() if c.payload)

# ------------------------------------------------------------------ frames nobody asked for

# The server always sends msg, server and version; they are informational, so a
# receiver does not insist on them.
GREETING_MESSAGE = Message(GREETING, (optional(Key.MSG, STR), optional(Key.SERVER, STR), optional(Key.VERSION, INT),
                                      optional(Key.AUTH, STR), optional(Key.NONCE, BYTES),
                                      optional(Key.SHM, MAP), optional(Key.MAX_FRAME, INT),
                                      optional(Key.WORKERS, MAP)))
NOTIFICATION = Message(NOTIFY, (Field(Key.BIN, STR), Field(Key.N, INT), Field(Key.SEQ, INT), Field(Key.OP, STR),
                                optional(Key.TAG, TAG),
                                # a relay's INCOMING carrying the copy as its payload (§11)
                                optional(Key.ITEMS, _A_LIST), optional(Key.SIZES, _A_LIST),
                                optional(Key.TAGS, TAGS), optional(Key.CHANGE, STR)))
KEEPALIVE_MESSAGE = Message(KEEPALIVE, (optional(Key.MSG, STR),))
ERROR = Message(0, (optional(Key.MSG, STR),))  # any code >= 400; built with error_reply


def error_reply(code: int, message: str, rid: int = 0) -> dict:
    """The header of an error reply (any code >= 400)."""
    return {Key.CODE: code, Key.ID: rid, Key.MSG: message}
