"""Numbers for people: one rule for every table and figure label of the report.

* integers, and magnitudes of 1,000 and more: whole numbers with thousands separators (``124,311``);
* magnitudes from 0.001 to 1,000: 4 significant digits, no exponent (``3.226``, ``0.01163``);
* smaller magnitudes (numerical errors and the like): 2 significant digits times a power of ten
  (``2.4 × 10⁻⁷``), never ``2.4e-07``;
* ``0`` as ``0``, NaN as ``n/a``, infinities as ``∞``.
"""

from __future__ import annotations

import math
import numbers

_SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def format_number(value: float | int) -> str:
    """``value`` for people, by the rule in the module docstring.

    >>> [format_number(x) for x in (124311.4, 87072, 4989.0, 96.384, 0.011634, 2.4e-7, 0.0)]
    ['124,311', '87,072', '4,989', '96.38', '0.01163', '2.4 × 10⁻⁷', '0']
    """
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):,}"
    x = float(value)
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    if x == 0:
        return "0"
    magnitude = abs(x)
    if magnitude >= 999.95:  # what would round to 1000 at 4 significant digits joins the integers
        return f"{round(x):,}"
    if magnitude >= 1e-3:
        return f"{x:.4g}"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa} × 10{str(int(exponent)).translate(_SUPERSCRIPT)}"


def percent(fraction: float) -> str:
    """``fraction`` as a percentage by the same rule: ``percent(0.1234) == "12.34%"``."""
    return f"{format_number(100 * float(fraction))}%"


def signed_percent(fraction: float) -> str:
    """A difference as a percentage with its sign: ``+12.34%``, ``-3%``, ``0%``."""
    return ("+" if float(fraction) > 0 else "") + percent(fraction)
