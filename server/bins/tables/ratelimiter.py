"""When a table lets inserts and samples proceed: Reverb's rate limiter, decisions only.

Reverb's rule (``reverb/cc/rate_limiter.cc``; the Python ``SampleToInsertRatio`` and
``MinSize`` build it), with ``diff = inserts * samples_per_insert - samples``:

* a sample of ``n`` may proceed when the table holds at least
  ``min_size_to_sample`` rows and ``diff - n >= min_diff``;
* an insert of ``n`` may proceed when the table would then hold at most
  ``min_size_to_sample`` rows (filling up is never limited), or else when
  ``diff + n * samples_per_insert <= max_diff``.

``error_buffer`` ``b`` sets ``min_diff, max_diff = c - b, c + b`` around
``c = samples_per_insert * min_size_to_sample`` (the credit the first
``min_size_to_sample`` inserts earn), so that, past the minimum, inserts and samples
keep ``(inserts - min_size_to_sample) * samples_per_insert - samples`` within
``[-b, +b]``; a pair ``(min_diff, max_diff)`` is taken as is.  Without
``samples_per_insert`` only the minimum size limits (Reverb's ``MinSize``).  Reverb's
checks apply: ``min_size_to_sample >= 1``, a window ``max_diff - min_diff`` of at
least ``2 * max(1, samples_per_insert)``, and ``min_diff`` no higher than ``c``
(else no sample could ever follow the first inserts).

The limiter never waits: the table asks it, and its caller parks what may not proceed.
Changing the limits at run time (:meth:`set_limits`) starts the balance afresh, as if
the table had just been filled to its current size under the new limits: at the
centre of the window once past the minimum size.  The imbalance it forgets is at most
what the old window allowed, and a new ratio takes effect with neither a burst nor a
stall.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from .errors import TableSpecError


# The most a balance bound may be, and the most inserts a window may span: counts and
# their products stay exact floats, and the decisions' arithmetic finite (a window of
# 1e308, or a ratio of 1e-300, overflowed the counts of allowed rows to infinity).
MAX_BALANCE = 2.0 ** 53


class RateLimiter:
    """The rate-limiter state of one table: its limits and the insert/sample balance."""

    def __init__(self, min_size_to_sample: int = 1, samples_per_insert: float | None = None,
                 error_buffer: float | tuple[float, float] | None = None):
        self.set_limits(min_size_to_sample, samples_per_insert, error_buffer, size=0)

    def set_limits(self, min_size_to_sample: int = 1, samples_per_insert: float | None = None,
                   error_buffer: float | tuple[float, float] | None = None, *, size: int) -> None:
        """Check and take new limits; ``size`` is the table's row count now."""
        if (not isinstance(min_size_to_sample, Integral) or isinstance(min_size_to_sample, bool)
                or min_size_to_sample < 1):
            raise TableSpecError(f"min_size_to_sample must be an int >= 1, not {min_size_to_sample!r}")
        min_size_to_sample = int(min_size_to_sample)
        if samples_per_insert is None:
            if error_buffer is not None:
                raise TableSpecError("error_buffer needs samples_per_insert")
            spi, min_diff, max_diff = 1.0, -math.inf, math.inf
        else:
            spi = _number(samples_per_insert, "samples_per_insert")
            if not spi > 0:
                raise TableSpecError(f"samples_per_insert must be > 0, not {samples_per_insert!r}")
            centre = spi * min_size_to_sample
            if error_buffer is None:
                raise TableSpecError(f"samples_per_insert needs an error_buffer: how far samples may run "
                                     f"ahead of or behind the ratio (at least {max(1.0, spi):g}; a few "
                                     f"times the batch sizes of inserts and samples avoids stalls)")
            if isinstance(error_buffer, (tuple, list)):
                if len(error_buffer) != 2:
                    raise TableSpecError(f"error_buffer must be a number or (min_diff, max_diff), "
                                         f"not {error_buffer!r}")
                min_diff = _number(error_buffer[0], "min_diff")
                max_diff = _number(error_buffer[1], "max_diff")
            else:
                buffer = _number(error_buffer, "error_buffer")
                min_diff, max_diff = centre - buffer, centre + buffer
            if not max_diff - min_diff >= 2 * max(1.0, spi):
                raise TableSpecError(f"the error buffer's window ({min_diff:g}, {max_diff:g}) must span at "
                                     f"least 2 * max(1, samples_per_insert) = {2 * max(1.0, spi):g}, or it "
                                     f"could block inserts and samples for good")
            if max(-min_diff, max_diff) > MAX_BALANCE or (max_diff - min_diff) / spi > MAX_BALANCE:
                raise TableSpecError(f"the error buffer's window ({min_diff:g}, {max_diff:g}) is too wide for "
                                     f"samples_per_insert {spi:g}: its bounds, and the inserts it spans, must "
                                     f"stay within 2**53")
            if min_diff > centre:
                raise TableSpecError(f"min_diff {min_diff:g} is above samples_per_insert * min_size_to_sample "
                                     f"= {centre:g}: no sample could follow the first inserts")
        self.min_size_to_sample = min_size_to_sample
        self.samples_per_insert = None if samples_per_insert is None else spi
        self.error_buffer = (tuple(error_buffer) if isinstance(error_buffer, (tuple, list))
                             else error_buffer)
        self._spi, self.min_diff, self.max_diff = spi, min_diff, max_diff
        # diff = base + inserts * spi - samples counted since the last change of limits:
        # counts, not a running float sum, so a fractional ratio does not drift
        self._base = spi * min(size, min_size_to_sample)
        self._inserts = 0
        self._samples = 0

    @property
    def diff(self) -> float:
        """The balance the rule compares: credit earned by inserts minus samples taken."""
        return self._base + self._inserts * self._spi - self._samples

    # -- decisions

    # The two rules compute as Reverb's do, term for term, so that a fractional ratio
    # rounds the same way at the edges of the window.

    def can_insert(self, n: int, size: int) -> bool:
        """May an insert of ``n`` rows proceed into a table of ``size`` rows?"""
        if size + n <= self.min_size_to_sample:
            return True
        return self._base + (self._inserts + n) * self._spi - self._samples <= self.max_diff

    def can_sample(self, n: int, size: int) -> bool:
        """May a sample of ``n`` rows proceed from a table of ``size`` rows?"""
        if size < self.min_size_to_sample:
            return False
        return self._base + self._inserts * self._spi - self._samples - n >= self.min_diff

    def inserts_allowed(self, size: int) -> int | None:
        """The largest insert that may proceed now (None: no limit)."""
        if self.max_diff == math.inf:
            return None
        k = max(self.min_size_to_sample - size, math.floor((self.max_diff - self.diff) / self._spi), 0)
        while k > 0 and not self.can_insert(k, size):  # floor() and the rule may round differently
            k -= 1
        return k

    def samples_allowed(self, size: int) -> int | None:
        """The largest sample that may proceed now (None: no limit but the minimum size)."""
        if size < self.min_size_to_sample:
            return 0
        if self.min_diff == -math.inf:
            return None
        k = max(math.floor(self.diff - self.min_diff), 0)
        while k > 0 and not self.can_sample(k, size):
            k -= 1
        return k

    # Whether waiting could ever help.  Inserts raise the balance up to max_diff and
    # samples lower it down to min_diff; a balance outside the window (at the start,
    # say) only comes back into it.  Not counted on: rows removed otherwise than by the
    # limited operations, which could let a table refill below its minimum size again.

    def never_samples(self, n: int) -> bool:
        """True if no balance this limiter can reach lets a sample of ``n`` proceed."""
        return n > max(self.diff, self.max_diff) - self.min_diff

    def never_inserts(self, n: int) -> bool:
        """True if ``n`` rows are more than the minimum size (filling up to it is never
        limited) and no balance this limiter can reach lets them in."""
        return n > self.min_size_to_sample and n * self._spi > self.max_diff - min(self.diff, self.min_diff)

    # -- what happened

    def inserted(self, n: int) -> None:
        self._inserts += n

    def sampled(self, n: int) -> None:
        self._samples += n

    def info(self, size: int) -> dict:
        return {
            "min_size_to_sample": self.min_size_to_sample,
            "samples_per_insert": self.samples_per_insert,
            "error_buffer": list(self.error_buffer) if isinstance(self.error_buffer, tuple) else self.error_buffer,
            "min_diff": self.min_diff,
            "max_diff": self.max_diff,
            "diff": self.diff,
            "inserts_allowed": self.inserts_allowed(size),
            "samples_allowed": self.samples_allowed(size),
        }


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TableSpecError(f"{what} must be a finite number, not {value!r}")
    return float(value)
