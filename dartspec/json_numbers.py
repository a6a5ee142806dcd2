"""Bounds on a JSON number (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``, ``multipleOf``),
checked as the number is written: which prefixes can still end inside the bounds.

A bounded number is written without an exponent (else any prefix could still be scaled into range). The numbers a
prefix can become form intervals of magnitudes: ``12`` becomes 12 or something in [12, 13) (a fraction), or in
[120, 130), [1200, 1300), ... (more digits); ``12.3`` something in [12.3, 12.4); a minus sign mirrors them. A prefix
lives while one of those intervals meets the bounds (and, with ``multipleOf``, holds a multiple inside them: every
value of an interval can be written from its prefix); the number may end where its own value lies inside them.
Arithmetic is exact (:class:`~decimal.Decimal` from the schema's own digits, fractions for multiples).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

# An interval end: (value, closed), None for unbounded.
_End = tuple[Decimal, bool] | None


@dataclass(frozen=True)
class NumberBounds:
    low: Decimal | None = None
    high: Decimal | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    multiple: Decimal | None = None  # positive; for an integer, the integer multiples only count

    def __post_init__(self) -> None:
        if self.integer and self.multiple is not None:  # integer multiples of p/q (lowest terms) are those of p
            object.__setattr__(self, "multiple", Decimal(Fraction(self.multiple).numerator))
        if self.integer:  # the integers inside, as closed bounds
            low = (
                None
                if self.low is None
                else Decimal(math.floor(self.low) + 1 if self.low_open else math.ceil(self.low))
            )
            high = (
                None
                if self.high is None
                else Decimal(math.ceil(self.high) - 1 if self.high_open else math.floor(self.high))
            )
            object.__setattr__(self, "low", low)
            object.__setattr__(self, "high", high)
            object.__setattr__(self, "low_open", False)
            object.__setattr__(self, "high_open", False)

    def empty(self) -> bool:
        """Whether no number lies inside."""
        return not self._fits(None, None)

    def admits(self, text: bytes) -> bool:
        """Whether the whole number ``text`` lies inside."""
        value = Decimal(text.decode())
        return self._fits((value, True), (value, True))

    def _fits(self, low: _End, high: _End) -> bool:
        """Whether the interval from ``low`` to ``high`` holds a number inside (a multiple, where one is asked)."""
        low, high = _larger(self._low(), low), _smaller(self._high(), high)
        if not _meets(low, high, None, None):
            return False
        if self.multiple is None or low is None or high is None or not (low[0].is_finite() and high[0].is_finite()):
            return True  # an unbounded side holds multiples
        step = Fraction(self.multiple)
        k = math.ceil(Fraction(low[0]) / step)
        if k * step == low[0] and not low[1]:
            k += 1
        first = k * step
        return first < high[0] or (first == high[0] and high[1])

    def viable(self, text: bytes) -> bool:
        """Whether the number prefix ``text`` (sign, digits, a point, digits; no exponent) can still end inside."""
        negative = text.startswith(b"-")
        digits = text[1:] if negative else text
        whole, dot, fraction = digits.partition(b".")
        for a, b in self._magnitudes(whole.decode(), bool(dot), fraction.decode()):
            top = self.integer  # magnitudes [a, b), integers [a, b]
            low, high = ((-b, top), (-a, True)) if negative else ((a, True), (b, top))
            if self._fits(low, high):
                return True
            if self._past(a, negative):
                return False
        return False

    def _magnitudes(self, whole: str, dot: bool, fraction: str) -> Iterator[tuple[Decimal, Decimal]]:
        """The magnitudes the prefix can become, as intervals [a, b) (integers: [a, b] closed), smallest first."""
        if not whole:  # a lone minus sign
            yield Decimal(0), Decimal("Infinity")
            return
        m = Decimal(whole)
        if dot:
            a = Decimal(f"{whole}.{fraction}") if fraction else m
            yield a, a + (Decimal(10) ** -len(fraction) if fraction else Decimal(1))
            return
        if whole == "0":
            yield (Decimal(0), Decimal(0)) if self.integer else (Decimal(0), Decimal(1))
            return
        k = 0
        while True:
            scale = Decimal(10) ** k
            yield (m * scale, (m + 1) * scale - 1) if self.integer else (m * scale, (m + 1) * scale)
            k += 1

    def _past(self, magnitude: Decimal, negative: bool) -> bool:
        """Whether magnitudes from ``magnitude`` up lie wholly beyond the bounds (so larger ones do too)."""
        bound = (-self.low if self.low is not None else None) if negative else self.high
        return bound is not None and magnitude > abs(bound) + 1

    def _low(self) -> _End:
        return None if self.low is None else (self.low, not self.low_open)

    def _high(self) -> _End:
        return None if self.high is None else (self.high, not self.high_open)


def _meets(low1: _End, high1: _End, low2: _End, high2: _End) -> bool:
    """Whether two intervals (each given by its ends) share a point."""
    low, high = _larger(low1, low2), _smaller(high1, high2)
    if low is None or high is None:
        return True
    return low[0] < high[0] or (low[0] == high[0] and low[1] and high[1])


def _larger(x: _End, y: _End) -> _End:
    if x is None or y is None:
        return y if x is None else x
    if x[0] != y[0]:
        return x if x[0] > y[0] else y
    return (x[0], x[1] and y[1])  # a tie: the open end is the tighter


def _smaller(x: _End, y: _End) -> _End:
    if x is None or y is None:
        return y if x is None else x
    if x[0] != y[0]:
        return x if x[0] < y[0] else y
    return (x[0], x[1] and y[1])
