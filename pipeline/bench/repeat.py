"""Interleaved repetitions and the ratios read from them.

Every system of a cell runs once per repetition, in order, reversed every other repetition, so
a slow drift of the machine's speed favours no system; numbers are medians over repetitions,
and ratios are taken within one run. A paired ratio divides two systems' results repetition by
repetition, which cancels the swings between repetitions of a shared machine.
"""
from __future__ import annotations

import statistics


def run_order(systems: list, rep: int) -> list:
    """The systems in the order repetition `rep` runs them. Example: [a, b, c] -> rep 0: a, b, c;
    rep 1: c, b, a."""
    return list(systems) if rep % 2 == 0 else list(systems)[::-1]


def paired(a: list[float], b: list[float]) -> dict:
    """a / b within each repetition: the median and the range over repetitions.
    Example: a = [2, 3], b = [1, 2] -> {"median": 1.75, "min": 1.5, "max": 2.0}."""
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def show_paired(r: dict) -> str:
    """'median (min-max)', two decimals."""
    return f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"
