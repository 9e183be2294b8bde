"""How the protocol's messages are declared: fields, their kinds, replies and verbs (PROTOCOL.md §4).

The machinery of :mod:`.messages`, in the manner of Twisted AMP's ``Command``: a
:class:`Command` declares a verb once, for both ends and for everything derived from
it, with its request fields, its success reply, whether the request carries a value
payload and how the server receives it (``payload``, :class:`Payload`), which reply
field is its result, and how the rest of the system treats it:
the client method that sends it (``method``), what same-host zero-copy may do for it
(``zero_copy``, :class:`ZeroCopy`), how a relay answers it (``relay``,
:class:`Relay`), which worker of a multi-worker server a client sends it to
(``route``, :class:`Route`), the lane a request of it waits in when it waits in the server
(``lane``) and in which order (``waits_in_order``) and the error codes it may answer with besides those any request may get
(``errors``).  The server checks requests with :meth:`Command.parse_request` (the
checks of PROTOCOL.md §4.2, in order) and answers with :meth:`Command.reply`; the
clients check their arguments with :meth:`Command.check_arguments`, build requests
with :meth:`Command.request` and check replies with :meth:`Command.check_reply`.
Frames nobody asked for and error replies are :class:`Message` declarations.
Torch-free: the server imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from ..errors import ProtocolError, RemoteError, UsageError, error_for_code
from ..wire.frames import head_template, one_item_template
from . import keys as Key  # (a module: Key.ID costs what a global does)
from .codes import (
    BAD_ARGS, BAD_FRAME, BAD_NAME, LOCAL_ERROR, NOT_AUTHENTICATED, UNAVAILABLE, UNKNOWN_VERB, WRONG_WORKER,
)

PROTOCOL_VERSION = 1

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
    a value is not one (None if it is); ``accepts(value)`` is the quick yes, and
    ``test``, where there is one, the same yes as an expression over ``v`` that a
    command's compiled request parser inlines (:func:`_compile_parser`)."""

    name: str
    problem: Callable[[str, Any, int], str | None]
    accepts: Callable[[Any], bool]
    test: str | None = None


_VALID_NAMES: set[str] = set()  # bin names found valid (default limit), so a name is checked once
_MAX_VALID_NAMES = 4096


def _valid_name(name: str) -> bool:
    """Whether ``name`` is a valid bin name (the default limit), remembering the yes."""
    if check_bin_name(name) is not None:
        return False
    if len(_VALID_NAMES) >= _MAX_VALID_NAMES:
        _VALID_NAMES.clear()
    _VALID_NAMES.add(name)
    return True


# What a kind's test may name besides ``v`` (the source is built from the declarations only).
_ONLY_INT = frozenset((int,))
_TEST_NAMES = {"TAG_MIN": TAG_MIN, "TAG_MAX": TAG_MAX, "_VALID_NAMES": _VALID_NAMES, "_valid_name": _valid_name,
               "_ONLY_INT": _ONLY_INT}


def _kind(name: str, accepts: Callable[[Any], bool] | str) -> Kind:
    """A kind whose values are those ``accepts`` says yes to; given as a test (an
    expression over ``v``), the kind is also inlined in compiled parsers."""
    test = None
    if isinstance(accepts, str):
        test, accepts = accepts, _compile(f"lambda v: {accepts}", "<kind test>")

    def problem(key: str, value: Any, _max_bin_name: int) -> str | None:
        return None if accepts(value) else f"{key} must be {name}, not {value!r:.40}"
    return Kind(name, problem, accepts, test)


def _compile(expression: str, where: str):
    """The value of a Python expression built from the declarations (never from
    received bytes): a kind's test."""
    return eval(compile(expression, where, "eval"), dict(_TEST_NAMES))  # noqa: S307


def _counts(value: Any) -> bool:
    return type(value) is dict and all(type(k) is str and type(v) is int for k, v in value.items())


INT = _kind("an integer", "type(v) is int")
BOOL = _kind("a boolean", "type(v) is bool")
STR = _kind("a string", "type(v) is str")
BYTES = _kind("bytes", "type(v) is bytes")
INTS = _kind("a list of integers", "type(v) is list and _ONLY_INT.issuperset(map(type, v))")
A_LIST = _kind("a list", "type(v) is list")
COUNTS = _kind("a map of strings to integers", _counts)
MAP = _kind("a map", "type(v) is dict")
ANY = _kind("anything", "True")
TAG = Kind("a tag", lambda key, value, limit: check_tag(value), lambda value: check_tag(value) is None,
           "v is None or (type(v) is int and TAG_MIN <= v <= TAG_MAX)")
BIN_NAME = Kind("a bin name", lambda key, value, limit: check_bin_name(value, limit),
                lambda value: check_bin_name(value) is None,
                "type(v) is str and (v in _VALID_NAMES or _valid_name(v))")
TAGS = _kind("a list of tags", lambda v: type(v) is list and all(check_tag(t) is None for t in v))
COUNT = _kind("an integer of at least 1", "type(v) is int and v >= 1")
SHORT_BYTES = _kind("bytes of at most 64", "type(v) is bytes and len(v) <= 64")
MAX_WAIT = 86400.0  # seconds a request may ask the server to hold it
SECONDS = _kind(f"a number of seconds, 0 to {MAX_WAIT:g}",
                f"type(v) in (int, float) and 0 <= v <= {MAX_WAIT!r}")


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
        # check(header): the usual header passed by one function made from the fields.
        self.check = _compile_check(self)
        # head(rid, *values): the whole frame of this reply with its required fields
        # (all integers, in order) and none of its optional ones, from a prepared
        # template; None for a message with other required fields.
        ints = tuple(f.key for f in fields if f.required)
        self.head = None
        if code and len(ints) <= 2 and all(f.kind is INT for f in fields if f.required):
            self.head = head_template({Key.CODE: code}, (Key.ID, *ints))
        # lone(rid, seq, blob, nbytes): the frame head of this reply carrying one item
        # and none of its optional fields, from a prepared template (and lone.read,
        # its reader); None for a message whose required fields are not an items
        # reply's (seq, items, sizes).
        self.lone = None
        if code and ints == (Key.SEQ, Key.ITEMS, Key.SIZES):
            self.lone = one_item_template({Key.CODE: code}, (Key.ID, Key.SEQ, Key.ITEMS, Key.SIZES))

    def build(self, rid: int = 0, **fields) -> dict:
        """The header of this message (for request ``rid``; 0: unsolicited)."""
        if not fields:
            return {Key.CODE: self.code, Key.ID: rid}
        header = {Key.CODE: self.code, Key.ID: rid}
        header.update(fields)
        return header

    def check(self, header: dict) -> dict:
        """``header``, once it is found to hold every declared field right;
        :class:`ProtocolError` otherwise (the peer broke the protocol).  (Each
        message replaces this with its compiled check, :func:`_compile_check`,
        which comes here only for a header it does not pass.)"""
        for field in self.fields:
            problem = field.problem(header)
            if problem is not None:
                raise ProtocolError(f"{self.code} reply: {problem}")
        return header


class ZeroCopy:
    """What same-host zero-copy (PROTOCOL.md §10) may do for a verb (``Command.zero_copy``;
    None: the request and its reply always travel over TCP)."""

    STORE = "store"  # its value may be written into the server's shared memory and named (§10.4)
    READ = "read"  # its reply may refer to files (§10.3); if they cannot be mapped, it is sent again over TCP
    TAKE = "take"  # as READ, but never sent again: its items were taken, its rows counted


class Payload:
    """How a verb's value payload is received (``Command.payload``; None: it carries none)."""

    ITEM = "item"  # kept as an item, in the pieces it arrived in (PUT, APPEND)
    ROWS = "rows"  # read into one buffer, where a table views its columns in place (TINSERT, TWRITE)


class Relay:
    """How a relay (PROTOCOL.md §11) answers a verb (``Command.relay``)."""

    # A change of a followed bin: sent upstream as it came, answered with the upstream's
    # answer once the relay's mirror of the bin shows the change (read-your-writes; its
    # reply must say the change's seq, which the relay waits for).
    FORWARD = "forward"
    PASS = "pass"  # about a followed name a relay never mirrors (a table): sent upstream, its reply passed back
    MIRROR = "mirror"  # for a followed bin: answered from the relay's mirror, once it holds a copy
    MERGE = "merge"  # the upstream's answer and the relay's own, merged (LIST)
    LOCAL = "local"  # answered by the relay itself, as by any server

    ALL = frozenset({FORWARD, PASS, MIRROR, MERGE, LOCAL})


class Route:
    """Which worker of a multi-worker server (PROTOCOL.md §14) a client sends a verb to
    (``Command.route``); with one server process every verb goes to it."""

    OWNER = "owner"  # to the worker that owns its bin (or table); others refuse it with 427
    MERGE = "merge"  # to every worker, their replies merged into one (LIST)
    EVERY = "every"  # to every worker the client has a connection to, answered once all are (NOOP)
    CONNECTION = "connection"  # a matter of the connection it is sent on (AUTH: each one's own opening)

    ALL = frozenset({OWNER, MERGE, EVERY, CONNECTION})


# Error codes any request may get, whatever its verb (a relay whose upstream is gone,
# a bug, framing, arguments, an unknown verb, no authentication): not declared per verb.
ANY_REQUEST_ERRORS = frozenset({UNAVAILABLE, LOCAL_ERROR, BAD_FRAME, BAD_ARGS, UNKNOWN_VERB, NOT_AUTHENTICATED})


class Command:
    """A verb, declared once (see the module docstring).

    ``result`` names the reply field a client returns by default (None: nothing);
    ``payload`` says whether the request carries a value payload and how the server
    receives it (:class:`Payload`, or None).
    ``method`` is the name of the clients' method that sends it (None: AUTH, which
    the clients send while connecting).  ``zero_copy`` and ``relay`` must be
    declared for every verb (:class:`ZeroCopy` or None, :class:`Relay`), and so must
    ``route`` (:class:`Route`: ``OWNER`` exactly for the verbs that name a bin, which
    declare the 427 a worker that does not own the bin answers).  ``lane``:
    the verb's requests that wait in the server (PROTOCOL.md §4.5) wait in the lane
    of that name of their bin, in arrival order, apart from other kinds of request
    waiting on the same bin (None: it never waits); ``waits_in_order``: they go on in
    the order they came (False: each as soon as it may, as readers each waiting for
    their own version do).  ``errors``: the error codes it
    may answer with beyond :data:`ANY_REQUEST_ERRORS` (its PROTOCOL.md entry says when).
    ``lasting``: its effect outlives the connection (PROTOCOL.md §8.3): held back by
    flow control when the connection is lost, it is still carried out.
    ``taken_with``: for a ``READ`` verb, the request field that, when true, makes it
    count what it reads (TREAD's ``sample``): such a request is a ``TAKE``, never sent
    again.
    """

    def __init__(self, verb: str, fields: tuple[Field, ...] = (), *, reply: Message, method: str | None,
                 zero_copy: str | None, relay: str, route: str, lane: str | None = None,
                 waits_in_order: bool = True, errors: tuple[int, ...] = (),
                 payload: str | None = None, result: str | None = None, taken_with: str | None = None,
                 lasting: bool = False, doc: str = ""):
        if payload not in (None, Payload.ITEM, Payload.ROWS):
            raise ValueError(f"{verb}: unknown payload {payload!r}")
        if taken_with is not None and (zero_copy != ZeroCopy.READ
                                       or taken_with not in {field.key for field in fields}):
            raise ValueError(f"{verb}: taken_with names a field of a READ verb")
        if relay not in Relay.ALL or zero_copy not in (None, ZeroCopy.STORE, ZeroCopy.READ, ZeroCopy.TAKE):
            raise ValueError(f"{verb}: unknown relay treatment {relay!r} or zero-copy role {zero_copy!r}")
        takes_bin = any(field.key == Key.BIN for field in fields)
        if relay in (Relay.FORWARD, Relay.PASS, Relay.MIRROR) and not takes_bin:
            raise ValueError(f"{verb}: a relay forwards or mirrors only what names a bin (or table)")
        if relay == Relay.FORWARD and not any(f.key == Key.SEQ and f.required for f in reply.fields):
            raise ValueError(f"{verb}: a FORWARD verb's reply says the seq of its change (the relay waits for "
                             f"its mirror to reach it)")
        if not waits_in_order and lane is None:
            raise ValueError(f"{verb}: only a verb that waits in a lane waits in an order")
        if route not in Route.ALL or (route == Route.OWNER) != takes_bin \
                or (WRONG_WORKER in errors) != (route == Route.OWNER):
            raise ValueError(f"{verb}: route {route!r} must be {Route.OWNER!r} (with error {WRONG_WORKER}) exactly "
                             f"when the verb names a bin")
        self.verb = verb
        self.fields = fields
        self.success = reply
        self.reply = reply.build  # reply(rid, **fields): the success reply header to request ``rid``
        self.method = method
        self.zero_copy = zero_copy
        self.relay = relay
        self.route = route
        self.lane = lane
        self.waits_in_order = waits_in_order
        self.errors = frozenset(errors)
        self.payload = payload
        self.result = result
        self.taken_with = taken_with
        self.lasting = lasting
        self.doc = doc
        self.takes_bin = takes_bin
        self.keys = frozenset(field.key for field in fields)  # the request fields it declares
        slots = tuple(field.key for field in fields)
        self.Request = type(f"{verb.title()}Request", (Request,), {"__slots__": slots})
        self._slots = slots
        # parse_right(header, rid, payload, payload_len): parse_request's usual case, every
        # field right (and a payload only where one is declared; bin names within the
        # default limit), compiled from the fields once; None when anything is not:
        # parse_request then finds what and says it.
        self.parse_right = _compile_parser(self)
        # again(values, rid, payload, payload_len): a request whose fields hold ``values``
        # (what fields_of gave for one parsed before), for a head found again byte for
        # byte but for its id (tensorshare.wire.heads): nothing to check again.
        self.again = _compile_again(self)

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

    def fields_of(self, request: Request) -> tuple:
        """The values of ``request``'s fields, in declaration order (see ``again``)."""
        return tuple(getattr(request, key) for key in self._slots)

    def parse_request(self, header: dict, rid: int, payload: Any, payload_len: int,
                      max_bin_name: int = MAX_BIN_NAME) -> Request:
        """The typed request in ``header`` (whose ``op`` and ``id`` were checked);
        raises the :class:`RemoteError` to answer with (PROTOCOL.md §4.2, steps 3-5)."""
        if max_bin_name == MAX_BIN_NAME:  # (the compiled test of a bin name assumes the default limit)
            request = self.parse_right(header, rid, payload, payload_len)
            if request is not None:
                return request
        if payload_len and not self.payload:
            raise error_for_code(BAD_ARGS, f"{self.verb} takes no payload")
        request = self.Request()
        request.command, request.id, request.payload, request.payload_len = self, rid, payload, payload_len
        for field in self.fields:  # find what is wrong, and say it
            problem = field.problem(header, max_bin_name)
            if problem is not None:
                raise error_for_code(field.code, problem)
            setattr(request, field.key, header.get(field.key))
        return request


def _compile_parser(command: Command) -> Callable[[dict, int, Any, int], Request | None]:
    """``parse(header, rid, payload, payload_len)``: ``command``'s request when every
    field of ``header`` is right, else None (:meth:`Command.parse_request` then
    finds what is wrong and says it).  One function per command, made from its
    fields when it is declared (:func:`_compile_fields`): each field's kind inlined
    where it has a ``test``, instead of a loop over the fields per request; the
    optional fields looked for only while the header has keys left that the
    required ones, ``op`` and ``id`` do not account for (a usual request names few
    of them, and most none)."""
    optional = [field for field in command.fields if not field.required]
    prologue = [*(() if command.payload else ["if payload_len: return None"]),
                "request = Request()",
                "request.command, request.id, request.payload, request.payload_len = command, rid, payload, payload_len"]
    if optional:
        prologue.append(" = ".join(f"request.{field.key}" for field in optional) + " = None")
    return _compile_fields("parse", "header, rid, payload, payload_len", f"<{command.verb} request parser>",
                           command.fields, (Key.OP, Key.ID), prologue, "None", "request",
                           {"Request": command.Request, "command": command}, keep=True)


def _compile_again(command: Command) -> Callable[[tuple, int, Any, int], Request]:
    """``again(values, rid, payload, payload_len)`` for ``command`` (see ``Command.again``),
    made from its fields as :func:`_compile_parser` is."""
    slots = command._slots
    body = ["def again(values, rid, payload, payload_len):",
            "    request = Request()",
            "    request.command, request.id, request.payload, request.payload_len = command, rid, payload, payload_len",
            *([f"    {', '.join(f'request.{key}' for key in slots)}, = values"] if slots else []),
            "    return request"]
    scope = {"Request": command.Request, "command": command}
    exec(compile("\n".join(body), f"<{command.verb} request again>", "exec"), scope)  # noqa: S102
    return scope["again"]


def _compile_check(message: Message) -> Callable[[dict], dict]:
    """``check(header)`` for ``message``: the header when every declared field is
    right, else :meth:`Message.check`'s error.  Made from the fields as
    :func:`_compile_parser` makes a request parser, the undeclared ``code`` and
    ``id`` standing for ``op`` and ``id``."""
    return _compile_fields("check", "header", f"<{message.code} reply check>", message.fields, (Key.CODE, Key.ID),
                           [], "wrong(header)", "header", {"wrong": partial(Message.check, message)})


def _compile_fields(name: str, params: str, where: str, fields: tuple[Field, ...], spare: tuple[str, ...],
                    prologue: list[str], wrong: str, right: str, names: dict[str, Any], keep: bool = False):
    """The function ``name(params)`` of a header's ``fields`` (source built from the
    declarations only, never from received bytes): after the ``prologue`` lines, each
    required field's value is fetched and its kind inlined, returning ``wrong`` where
    one is absent or not of its kind; the optional ones are looked for only while the
    header has keys left that the required ones and the ``spare`` keys (where not
    declared) do not account for; ``right`` is returned when every field is right.
    ``keep``: each value found is set on ``request`` too."""
    required = [field for field in fields if field.required]
    optional = [field for field in fields if not field.required]
    declared = {field.key for field in fields}
    body = [f"def {name}({params}):", "    get = header.get", *(f"    {line}" for line in prologue)]

    def test_of(i: int, field: Field) -> str:
        if field.kind.test is not None:
            return field.kind.test
        names[f"accepts_{i}"] = field.kind.accepts
        return f"accepts_{i}(v)"

    for i, field in enumerate(required):
        body += [f"    v = get({field.key!r})",
                 f"    if v is None or not ({test_of(i, field)}): return {wrong}",
                 *([f"    request.{field.key} = v"] if keep else [])]
    if optional:
        others = "".join(f" - ({key!r} in header)" for key in spare if key not in declared)
        body += [f"    left = len(header) - {len(required)}{others}  # keys besides the required fields and {spare}",
                 f"    if left <= 0: return {right}"]
        for i, field in enumerate(optional, len(required)):
            body += [f"    v = get({field.key!r})",
                     "    if v is not None:",
                     f"        if not ({test_of(i, field)}): return {wrong}",
                     *([f"        request.{field.key} = v"] if keep else []),
                     "        left -= 1",
                     f"        if not left: return {right}"]
    body.append(f"    return {right}")
    scope = {**_TEST_NAMES, **names}
    exec(compile("\n".join(body), where, "exec"), scope)  # noqa: S102
    return scope[name]


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
