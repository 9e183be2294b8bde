"""Every header key, by name (PROTOCOL.md §4.1): ``Key.ID`` and the like.

A module, imported as ``Key`` (``from .schema import Key``), rather than a class:
Python 3.11 looks a class attribute up the slow way on every use, where a module's
is as quick as a global, and the request path reads these keys a few dozen times
per request.
"""

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
