"""The errors of the table engine, each on the reply code the server answers it with.

Every class derives from :class:`TableError` (catch them all) and from the
:mod:`tensorshare.errors` class of its reply code, so the server can answer
``exc.code`` and ``exc.message`` without a table of its own, and a client that
gets the code back raises the matching tensorshare error.
"""

from __future__ import annotations

from tensorshare.errors import BadRequestError, ServerLocalError, TensorShareError, TooLargeError, TransientError


class TableError(TensorShareError):
    """Base class of the errors a table raises."""


class TableSpecError(TableError, BadRequestError):
    """501: a table cannot be made (or its limits changed) as asked: unknown sampler or
    remover, bad capacity, column spec, exponent or rate-limiter settings."""


class ColumnMismatchError(TableError, BadRequestError):
    """501: a batch does not match the table's columns: a missing or unknown column, a
    wrong dtype or shape, columns of different lengths, a buffer of the wrong size."""


class BadArgumentError(TableError, BadRequestError):
    """501: an argument of the wrong kind: a row count that is not an int >= 0, keys
    or indices that are not integers."""


class SlotIndexError(TableError, BadRequestError, IndexError):
    """501: a slot index outside ``[0, capacity)``, or one index twice in a write."""


class EmptySlotError(TableError, BadRequestError):
    """501: a read of a slot that holds no row (never written, or its row was removed)."""


class PriorityError(TableError, BadRequestError):
    """501: a priority that is negative, not finite, or priorities of the wrong count."""


class TableFullError(TableError, TooLargeError):
    """552: every slot holds a row and the table has no remover (``remover=None``), or
    the table has handed out every key it can form."""


class BatchTooLargeError(TableError, TooLargeError):
    """552: more rows than the table's capacity in one insert, or a sample or insert
    larger than its rate limiter can ever let through (waiting would never end)."""


class EmptyTableError(TableError, TransientError):
    """450: a sample from a table that holds no row."""


class WouldBlockError(TableError, TransientError):
    """450: the rate limiter (or, for a sample, what the rows may still be sampled) does
    not let this insert or sample proceed now.  The caller parks the request and tries
    again once :attr:`Table.version` changes."""


class RowsNotWrittenError(TableError, ServerLocalError):
    """451: a batch's rows could not be written to the table's files (a disk error);
    the batch is not in the table, and the rows it was to replace have left it."""


class RowsNotReadError(TableError, ServerLocalError):
    """451: rows could not be read from the table's files (a disk error, a file cut
    short); the sample or read counted nothing."""


class NotFlushedError(TableError, ServerLocalError):
    """451: a change could not be flushed to the table's files (``--fsync``: a disk
    error); the change was undone, or, for a sample's counts, says so."""
