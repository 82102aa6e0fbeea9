"""Argument checks shared by every layer: one source for each rule and its error message.

Each check raises ``TypeError`` for a value of the wrong type and ``ValueError`` for one out of
range, naming the parameter and the accepted range, e.g. ``window must be an int >= 1, got 0``.
``all_ints`` is the element test of token-id lists (each caller words its own error).
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["ArgumentTypeError", "check_int", "check_float", "check_bool", "check_tau", "check_choice", "all_ints"]


class ArgumentTypeError(TypeError, ValueError):
    """A parameter of the wrong type. Also a ``ValueError``, so callers that catch bad values
    (the servers' 4xx mapping, older call sites) catch it too."""


def _range(lo, hi, kind: str) -> str:
    if hi is None:
        return f"{kind} >= {lo}"
    return f"{kind} in [{lo}, {hi}]"


def check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    """``value`` must be an int (not a bool) in ``[lo, hi]`` (``hi`` None: unbounded). Returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an {_range(lo, hi, 'int')}, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an {_range(lo, hi, 'int')}, got {value}")
    return value


def check_float(name: str, value: Any, lo: float, hi: float | None = None, *, lo_open: bool = False,
                hi_open: bool = False) -> float:
    """``value`` must be a finite real number in ``[lo, hi]`` (``(`` / ``)`` with ``lo_open`` / ``hi_open``;
    ``hi`` None: unbounded). Returns it as float."""
    if hi is None:
        accepted = f"float {'>' if lo_open else '>='} {lo}"
    else:
        accepted = f"float in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a {accepted}, got {type(value).__name__} {value!r}")
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = hi is not None and (value >= hi if hi_open else value > hi)
    if not math.isfinite(value) or bad_lo or bad_hi:
        raise ValueError(f"{name} must be a {accepted}, got {value}")
    return float(value)


def check_tau(name: str, value: Any) -> float:
    """MAC's threshold parameter: a float in ``[0, 1)``."""
    return check_float(name, value, 0.0, 1.0, hi_open=True)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def all_ints(values: list | tuple) -> bool:
    """Whether every element of ``values`` is an int and not a bool (True when empty). The distinct element
    types are checked, not each element: a 32K-token prompt in ~0.6 ms instead of ~3 ms per Python-level pass."""
    return all(issubclass(t, int) and not issubclass(t, bool) for t in set(map(type, values)))
