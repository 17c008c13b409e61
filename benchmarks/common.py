"""Timing helpers shared by the benchmarks: medians of repeats, a ratio table, machine facts."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch


def median_seconds(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_pair_seconds(
    fa: Callable[[], Any], fb: Callable[[], Any], repeats: int = 5, warmup: int = 1
) -> tuple[float, float]:
    """Median wall times of ``fa()`` and ``fb()``, run alternately (a ratio of the two then
    sees the same machine: this one is shared, and its speed drifts within seconds)."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, out in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def cpu_model() -> str:
    """The CPU's model name and widest vector unit (Linux), or the platform's processor."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        "unknown CPU",
    )
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({simd})"


def machine() -> str:
    """One line about where the numbers come from."""
    return (
        f"{platform.machine()} · {cpu_model()} · {os.cpu_count()} CPUs · "
        f"torch {torch.__version__} "
        f"({torch.get_num_threads()} threads"
        f"{', MKL_CBWR=' + os.environ['MKL_CBWR'] if os.environ.get('MKL_CBWR') else ''}) · "
        f"numpy {np.__version__} · "
        f"cuda {'yes: ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no'}"
    )


def table(rows: list[tuple[str, float, str]], reference: float, ref_name: str) -> str:
    """Rows of (name, seconds, note) with each one's ratio to ``reference``."""
    width = max(len(r[0]) for r in rows) + 2
    out = [f"{'':<{width}}{'median s':>11}{'× ' + ref_name:>16}  note"]
    for name, sec, note in rows:
        out.append(f"{name:<{width}}{sec:>11.4f}{sec / reference:>16.2f}  {note}")
    return "\n".join(out)


def print_verdicts(verdicts: Sequence[tuple[Any, ...]]) -> None:
    """One line per (name, value, bound, "≤" or "≥"[, unit]), in the format benchmarks/run.py reads.

    The unit is "×" (a ratio) unless given, e.g. " s" for a wall time.
    """
    for name, value, target, op_, *rest in verdicts:
        unit = rest[0] if rest else "×"
        met = value <= target if op_ == "≤" else value >= target
        print(
            f"{name} = {value:.2f}{unit} (target {op_} {target:g}{unit}: "
            f"{'met' if met else 'NOT met'})"
        )


def into_readme(text: str, block: str, body: str, command: str) -> str:
    """``text`` (the README) with its generated block ``block`` replaced by ``body``.

    The block lies between ``<!-- {block}:start -->`` and ``<!-- {block}:end -->``;
    ``command`` is what wrote it (said in the block: never edited by hand).
    """
    start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
    head, found, rest = text.partition(start)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise SystemExit(f"README.md has no {start} … {end} block to write into")
    note = f"<!-- written by `{command}`; not edited by hand -->"
    return f"{head}{start}\n{note}\n\n{body}\n{end}{tail}"
