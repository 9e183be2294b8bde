"""The protocol's messages, declared once for both ends (PROTOCOL.md §4-§6, §8, §10-§12).

PROTOCOL.md is the normative text; this module is its machine-readable half.  Every
verb is one :class:`~.schema.Command` (the machinery is :mod:`.schema`): its request
fields, its success reply, its payload and result, the clients' method that sends
it, what same-host zero-copy may do for it, how a relay answers it (a change of a
bin waits for the relay's mirror: ``Relay.FORWARD``), which worker of a multi-worker
server it goes to, the lane it waits in (and in which order) and its errors.  The rest is
derived from these declarations: the clients' routing (``tensorshare/_client/routing.py``;
to workers: ``protocol/router.py``), the relay's handlers (``server/relay/forward.py``),
``ShardedClient``'s per-bin methods, the server's wait lanes and ownership check, and
the tests that go over every verb.  Frames nobody asked for (the
greeting, notifications, keepalives) and error replies are
:class:`~.schema.Message` declarations.  Torch-free: the server imports it.

Adding a verb: declare it here, handle it in ``server/protocol/handlers.py`` (or
``tables.py``), give the clients the method it names (``tensorshare/_client/methods.py``)
and describe it in PROTOCOL.md.
"""

from __future__ import annotations

from .codes import (  # noqa: F401 - the codes are part of what this module declares
    AUTHENTICATED, BAD_ARGS, BAD_FRAME, BAD_NAME, BAD_SEQUENCE, BUSY, DONE, GREETING, ITEMS, KEEPALIVE, LIST_OK,
    LOCAL_ERROR, NO_SUCH_BIN, NOT_AUTHENTICATED, NOTIFY, OK, STORAGE_FULL, TOO_LARGE, UNAVAILABLE, UNKNOWN_VERB,
    WRONG_WORKER, ZERO_COPY_REFUSED,
)
from .schema import (  # noqa: F401 - the machinery, for those that import it from here
    A_LIST, ANY, ANY_REQUEST_ERRORS, BIN, BOOL, BYTES, COUNT, COUNTS, ID_MAX, INT, INTS, MAP, MAX_BIN_NAME,
    MAX_RELEASE_IDS, MAX_REPLY_HEADER, MAX_WAIT, PROTOCOL_VERSION, RELEASE, SECONDS, SHORT_BYTES, STR, TAG, TAG_MAX,
    TAG_MIN, TAGS, Command, Field, Key, Message, Payload, Relay, Request, Route, ZeroCopy, check_bin_name, check_tag, optional,
    reply_error,
)

_FREED = optional(Key.FREED, INTS)  # a publisher's device references no item holds any more (§13.3)
_CHANGED = Message(DONE, (Field(Key.N, INT), Field(Key.SEQ, INT), _FREED))
_DONE = Message(OK, (_FREED,))
_STORED = Message(DONE, (*_CHANGED.fields, optional(Key.MAPPED, BOOL)))  # (§10.4: readers map the bin)
_ITEMS = Message(ITEMS, (Field(Key.SEQ, INT), Field(Key.ITEMS, A_LIST), Field(Key.SIZES, A_LIST),
                         optional(Key.REFS, A_LIST), optional(Key.TAGS, TAGS), optional(Key.CUDA, A_LIST)))
_STORE_FIELDS = (
    BIN,
    Field(Key.VALUE, BYTES, missing="missing value description"),
    optional(Key.TAG, TAG),
    optional(Key.SHM, ANY),  # the item directory a same-host client wrote (§10.4)
    optional(Key.SIZE, INT),
    RELEASE,
)
_READ_FIELDS = (BIN, optional(Key.REF, INTS), RELEASE, optional(Key.TAGS, BOOL))
_NAMED = (BAD_NAME, WRONG_WORKER)  # any verb that names a bin: a bad name; another worker's bin (§14.3)
_STORE_ERRORS = (*_NAMED, TOO_LARGE, STORAGE_FULL, ZERO_COPY_REFUSED)
OWNER = optional(Key.OWNER, SHORT_BYTES)  # which client of a relay's connection owns an ephemeral bin (§4.6)

# -- bins (§4.3)

PUT = Command("PUT", (*_STORE_FIELDS, optional(Key.EPHEMERAL, BOOL), OWNER, optional(Key.CUDA, MAP),
                      optional(Key.FILL, INT)),
              reply=_STORED, payload=Payload.ITEM, result=Key.N, method="put", zero_copy=ZeroCopy.STORE,
              lasting=True, relay=Relay.FORWARD, route=Route.OWNER, errors=_STORE_ERRORS,
              doc="replace the bin's items with one item (ephemeral: for as long as this connection lasts; "
                  "cuda: by reference to the client's device memory; fill: that item's bytes)")
APPEND = Command("APPEND", (*_STORE_FIELDS, optional(Key.BELOW, COUNT), optional(Key.WAIT, SECONDS)),
                 reply=_STORED, payload=Payload.ITEM, result=Key.N, method="append", zero_copy=ZeroCopy.STORE,
                 lasting=True, relay=Relay.FORWARD, route=Route.OWNER, lane="room", errors=(*_STORE_ERRORS, BUSY),
                 doc="add one item at the end of the bin (with below: once it holds fewer items)")
GET = Command("GET", (*_READ_FIELDS, optional(Key.MAX, COUNT), optional(Key.WAIT, SECONDS),
                     optional(Key.LEAST, COUNT)), reply=_ITEMS, result=Key.ITEMS, method="get",
              zero_copy=ZeroCopy.TAKE, relay=Relay.FORWARD, route=Route.OWNER, lane="take",
              errors=(*_NAMED, NO_SUCH_BIN),
              doc="take the bin's items (at most max of them) out of it (with wait: once it holds least)")
PEEK = Command("PEEK", (*_READ_FIELDS, optional(Key.WAIT, SECONDS), optional(Key.SINCE, INT),
                       optional(Key.INCOMING, BOOL), optional(Key.CUDA, A_LIST)), reply=_ITEMS, result=Key.ITEMS,
               method="peek", zero_copy=ZeroCopy.READ, relay=Relay.MIRROR, route=Route.OWNER, lane="peek",
               waits_in_order=False,
               errors=(*_NAMED, NO_SUCH_BIN),
               doc="read every item of the bin (with wait: once its seq is no longer since; "
                   "cuda: device references where this client can open them)")
LIST = Command("LIST", (RELEASE,), reply=Message(LIST_OK, (Field(Key.BINS, COUNTS), optional(Key.RELAY, MAP))),
               result=Key.BINS, method="list", zero_copy=None, relay=Relay.MERGE, route=Route.MERGE,
               doc="every bin and its item count")
DELETE = Command("DELETE", (BIN, RELEASE, OWNER), reply=_CHANGED, method="delete", zero_copy=None,
                 lasting=True, relay=Relay.FORWARD, route=Route.OWNER, errors=(*_NAMED, NO_SUCH_BIN, STORAGE_FULL),
                 doc="remove the bin and its items (with owner: only while that owns the ephemeral bin)")
LISTEN = Command("LISTEN", (BIN, optional(Key.FIRST_APPEND, BOOL), RELEASE),
                 reply=Message(OK, (Field(Key.EXISTS, BOOL), Field(Key.N, INT), Field(Key.SEQ, INT),
                                    Field(Key.TAG, TAG))),
                 method="listen", zero_copy=None, relay=Relay.MIRROR, route=Route.OWNER, errors=(*_NAMED, TOO_LARGE),
                 doc="notify this connection of the bin's changes; the reply is a snapshot")
UNLISTEN = Command("UNLISTEN", (BIN, RELEASE), reply=_DONE, method="unlisten", zero_copy=None, relay=Relay.LOCAL,
                   route=Route.OWNER, errors=_NAMED, doc="stop notifying this connection")
NOOP = Command("NOOP", (RELEASE,), reply=_DONE, method="ping", zero_copy=None, relay=Relay.LOCAL, route=Route.EVERY,
               doc="nothing: liveness and round-trip timing")
AUTH = Command("AUTH", (Field(Key.MECH, STR), Field(Key.NONCE, BYTES), Field(Key.PROOF, BYTES)),
               reply=Message(AUTHENTICATED, (Field(Key.PROOF, BYTES), optional(Key.SHM, MAP))),
               method=None, zero_copy=None, relay=Relay.LOCAL, route=Route.CONNECTION, errors=(BAD_SEQUENCE,),
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
    REPLACE = "replace"  # TCREATE: a table there is replaced by a new one, once its settings are accepted
    SAMPLE = "sample"  # TREAD: the rows were drawn by the reader: count (and rate-limit) them as a sample
    EMPTY = "empty"  # TREAD: a slot that holds no row reads as key -1 and zeros, not a 501
    SLOTS = "slots"  # TINFO: the occupied slots from this index on (a page of them)
    ENDS = "ends"  # TINSERT/TWRITE: one byte per row, nonzero where the row ends its episode
    TIMES_SAMPLED = "times_sampled"  # TWRITE: how many times each row was sampled already (int64 bytes)
    LENGTH, PAD = "length", "pad"  # TSAMPLE: sequences of this many rows (pad: short ones padded)
    LENGTHS = "lengths"  # a sample of sequences: each one's real length (int64 bytes)
    KEY_RUNS = "key_runs"  # TINSERT/TWRITE: the keys may come back as runs [first, step, count, ...]


_TK = TableKey
# (the keys as int64 bytes, or as runs where the request accepted them: one of the two)
_TABLE_CHANGED = Message(DONE, (Field(Key.N, INT), Field(Key.SEQ, INT), optional(_TK.KEYS, BYTES),
                                optional(_TK.KEY_RUNS, INTS)))
# (§10.4: the table takes a same-host writer's rows from its files as they are: send them that way)
_TABLE_INSERTED = Message(DONE, (*_TABLE_CHANGED.fields, optional(Key.MAPPED, BOOL)))
_ROWS = Message(ITEMS, (*_ITEMS.fields, Field(_TK.KEYS, BYTES), Field(_TK.INDICES, BYTES),
                        optional(_TK.PROBABILITIES, BYTES), optional(_TK.COLUMNS, BOOL),
                        optional(_TK.TENSORDICT, BOOL), optional(_TK.LENGTHS, BYTES)))
_TABLE_INFO = Message(OK, (Field(_TK.INFO, MAP),))
_TABLE_VALUE = (Field(Key.VALUE, BYTES, missing="missing value description"),)
_TABLE_ERRORS = (NO_SUCH_BIN, *_NAMED)

TCREATE = Command("TCREATE", (BIN, Field(_TK.SPEC, MAP), optional(_TK.ADD_COLUMNS, BOOL), optional(_TK.REPLACE, BOOL),
                              RELEASE),
                  reply=_CHANGED, result=Key.N,
                  method="create_table", zero_copy=None, lasting=True, relay=Relay.PASS, route=Route.OWNER,
                  errors=(*_NAMED, TOO_LARGE, STORAGE_FULL),
                  doc="make a table (kept as it is if one with the same settings exists; with replace: a "
                      "table there is replaced, once the new settings are accepted)")
TINSERT = Command("TINSERT", (BIN, *_TABLE_VALUE, optional(_TK.PRIORITIES, BYTES), optional(Key.WAIT, SECONDS),
                              optional(_TK.TENSORDICT, BOOL), optional(_TK.ENDS, BYTES), optional(_TK.KEY_RUNS, BOOL),
                              optional(Key.SHM, ANY), optional(Key.SIZE, INT),  # rows a same-host client wrote (§10.4)
                              RELEASE),
                  reply=_TABLE_INSERTED, payload=Payload.ROWS, result=_TK.KEYS, method="insert",
                  zero_copy=ZeroCopy.STORE,
                  lasting=True, relay=Relay.PASS, route=Route.OWNER, lane="insert",
                  errors=(*_TABLE_ERRORS, TOO_LARGE, STORAGE_FULL, BUSY),
                  doc="add rows (waiting up to wait seconds for the rate limiter)")
TWRITE = Command("TWRITE", (BIN, *_TABLE_VALUE, Field(_TK.INDICES, BYTES), optional(_TK.PRIORITIES, BYTES),
                            optional(_TK.TENSORDICT, BOOL), optional(_TK.ENDS, BYTES), optional(_TK.KEY_RUNS, BOOL),
                            optional(_TK.TIMES_SAMPLED, BYTES), RELEASE),
                 reply=_TABLE_CHANGED, payload=Payload.ROWS, result=_TK.KEYS, method="write", zero_copy=None,
                 lasting=True, relay=Relay.PASS, route=Route.OWNER, errors=(*_TABLE_ERRORS, TOO_LARGE),
                 doc="put rows at the slot indices given")
TSAMPLE = Command("TSAMPLE", (BIN, Field(Key.N, COUNT), optional(Key.WAIT, SECONDS), optional(Key.REF, INTS),
                              optional(_TK.LENGTH, COUNT), optional(_TK.PAD, BOOL),
                              optional(_TK.KEYS, BYTES), optional(_TK.PRIORITIES, BYTES), RELEASE),
                  reply=_ROWS, result=Key.ITEMS, method="sample", zero_copy=ZeroCopy.TAKE, relay=Relay.PASS,
                  route=Route.OWNER, lane="sample", errors=(*_TABLE_ERRORS, TOO_LARGE, STORAGE_FULL, BUSY),
                  doc="draw n rows with the table's sampler (with length: n sequences of that many rows; "
                      "waiting up to wait seconds; with keys and priorities: set those first, as TPRIORITY)")
TREAD = Command("TREAD", (BIN, Field(_TK.INDICES, BYTES), optional(Key.REF, INTS), optional(_TK.SAMPLE, BOOL),
                          optional(_TK.EMPTY, BOOL), optional(Key.WAIT, SECONDS), RELEASE), reply=_ROWS, result=Key.ITEMS, method="read",
                zero_copy=ZeroCopy.READ, taken_with=_TK.SAMPLE, relay=Relay.PASS, route=Route.OWNER,
                lane="sample", errors=(*_TABLE_ERRORS, TOO_LARGE, STORAGE_FULL, BUSY),
                doc="read the rows at the slot indices given (with sample: as a sample the reader drew)")
TPRIORITY = Command("TPRIORITY", (BIN, Field(_TK.KEYS, BYTES), Field(_TK.PRIORITIES, BYTES), RELEASE),
                    reply=Message(OK, (Field(Key.N, INT),)), result=Key.N, method="update_priorities",
                    zero_copy=None, lasting=True, relay=Relay.PASS, route=Route.OWNER, errors=_TABLE_ERRORS,
                    doc="set the priorities of the rows with these keys")
TINFO = Command("TINFO", (BIN, optional(_TK.SLOTS, INT), RELEASE), reply=_TABLE_INFO, result=_TK.INFO,
                method="table_info", zero_copy=None, relay=Relay.PASS, route=Route.OWNER, errors=_TABLE_ERRORS,
                doc="the table's settings, counters and rate-limiter state (with slots: its occupied slots)")
TLIMITS = Command("TLIMITS", (BIN, Field(_TK.LIMITS, MAP), RELEASE), reply=_TABLE_INFO, result=_TK.INFO,
                  method="set_table_limits", zero_copy=None, lasting=True, relay=Relay.PASS, route=Route.OWNER,
                  errors=_TABLE_ERRORS,
                  doc="change the table's rate limits now")
TABLE_COMMANDS = (TCREATE, TINSERT, TWRITE, TSAMPLE, TREAD, TPRIORITY, TINFO, TLIMITS)

COMMANDS: dict[str, Command] = {c.verb: c for c in (PUT, APPEND, GET, PEEK, LIST, DELETE, LISTEN, UNLISTEN,
                                                    NOOP, AUTH, *TABLE_COMMANDS)}
VERBS = frozenset(COMMANDS)
VERBS_WITH_BIN = frozenset(verb for verb, c in COMMANDS.items() if c.takes_bin)
VERBS_WITH_VALUE = frozenset(verb for verb, c in COMMANDS.items() if c.payload)
LANES = tuple(sorted({c.lane for c in COMMANDS.values() if c.lane is not None}))  # where requests wait (§4.5)

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
                                optional(Key.ITEMS, A_LIST), optional(Key.SIZES, A_LIST),
                                optional(Key.TAGS, TAGS), optional(Key.CHANGE, STR)))
KEEPALIVE_MESSAGE = Message(KEEPALIVE, (optional(Key.MSG, STR),))
ERROR = Message(0, (optional(Key.MSG, STR),))  # any code >= 400; built with error_reply


def error_reply(code: int, message: str, rid: int = 0) -> dict:
    """The header of an error reply (any code >= 400)."""
    return {Key.CODE: code, Key.ID: rid, Key.MSG: message}
