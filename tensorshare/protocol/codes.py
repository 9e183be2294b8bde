"""The protocol's reply codes (header key ``code``), FTP's in meaning (PROTOCOL.md §6).

1xx unsolicited/preliminary, 2xx success, 4xx refused for now (may succeed later),
5xx refused for good.  Each error code has its exception class in
:mod:`tensorshare.errors` (``error_for_code``).
"""

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
