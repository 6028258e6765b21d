"""Thresholds of `trainprof compare`: how far a metric may move in its bad direction ('+5%',
'-3%', '+2pp', '+512MiB', '+0.02'), and whether a move between two numbers exceeds one."""

from __future__ import annotations

import re
from dataclasses import dataclass


class ThresholdError(ValueError):
    pass


@dataclass(frozen=True)
class Threshold:
    """Fail when the metric moves in the bad `direction` (+1: increase is bad, -1: decrease is
    bad) by more than `value`: relative (fraction of the baseline) or absolute (metric units)."""

    direction: int
    value: float
    relative: bool = True

    def describe(self, unit: str = "") -> str:
        sign = "+" if self.direction > 0 else "-"
        if self.relative:
            return f"{sign}{self.value * 100:g}%"
        if unit == "fraction":
            return f"{sign}{self.value * 100:g}pp"
        return f"{sign}{self.value:g}" + (f" {unit}" if unit in ("ms",) else "")


_UNITS = {"pp": 0.01, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "ms": 1.0, "s": 1e3}
_THRESH = re.compile(r"^\s*([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z%]*)\s*$")


def parse_threshold(text: str, default_direction: int) -> Threshold:
    """'+5%' (relative), '-3%', '5%' (the metric's own bad direction), '+2pp' (absolute, for
    fractions: 2 percentage points), '+512MiB', '+0.02' (absolute, in the metric's units)."""
    m = _THRESH.match(str(text))
    if not m:
        raise ThresholdError(f"bad threshold {text!r}: expected e.g. +5%, -3%, +2pp, +512MiB")
    sign, num, unit = m.groups()
    direction = {"+": 1, "-": -1}.get(sign, default_direction)
    value = float(num)
    unit_l = unit.lower()
    if unit_l == "%":
        return Threshold(direction, value / 100.0, True)
    if unit_l and unit_l not in _UNITS:
        raise ThresholdError(f"bad threshold {text!r}: unknown unit {unit!r} "
                             f"(use %, pp, B/KiB/MiB/GiB, ms, s or none)")
    return Threshold(direction, value * _UNITS.get(unit_l, 1.0), False)


class UntrustedValue(ThresholdError):
    """A value a relative threshold cannot judge (negative, or not a finite number): input the
    gate cannot trust (exit 2), never a pass."""


def exceeds(th: Threshold, base: float, cand: float, direction: int) -> bool:
    """Did the metric move by more than the threshold in `direction`? From a baseline of 0 a
    relative threshold is exceeded by any move: the relative change is infinite."""
    delta = (cand - base) * direction
    if th.relative:
        return delta > 0 if base == 0 else delta / abs(base) > th.value
    return delta > th.value
