"""Compiled chunk kernels: when to compile, chunk sizes, and the per-process cache of kernels.

A freshly compiled kernel is checked against the eager one (the agreement
bound) and its finite flags against numpy's, also on a pixel with NaN input,
before a tile uses it; any failure falls back to eager.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gridsolve.schemas.errors import first_line
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.engine.pyparse import PARSE_LOCK
from gridsolve.stages.engine.timing import part
from gridsolve.stages.model.chunk_kernel import Kernel

#: ``compile: auto`` compiles for grids of at least this many pixels. Measured on the
#: 10×10×4 model (bench_model.py, 2 cores): compiling costs ≈ 5-9 s per process with
#: inductor's disk cache warm (≈ 20 s cold) and saves ≈ 0.6 µs per pixel over eager
#: (0.09 s vs 0.25 s for 250,000 pixels), so it pays there only beyond ≈ 10-30M pixels;
#: models whose eager backward is heavier pay sooner (set ``compile: always``). A pixel
#: count, not a timing, so the choice (and the output's bits) is the same on every run.
COMPILE_MIN_PIXELS = 20_000_000

#: Outputs of one chunk, in bytes: small enough that a chunk's pixel-first results are
#: still in cache when they are written pixel-last (measured on the 10×10×4 model, 2 cores:
#: 4,096-pixel chunks 0.67 s, 32,768-pixel chunks 2.3 s for 250,000 pixels, eager).
CHUNK_BYTES = 8 * 2**20

#: The same for a compiled kernel, which writes the stored layout directly (nothing to keep
#: in cache), so larger chunks only save its per-call cost, ≈ 0.2 ms (10×10×4 model, 250,000
#: pixels: 0.100 s with 8 MiB chunks, 0.094 s with 32 MiB).
CHUNK_BYTES_COMPILED = 32 * 2**20

#: Pixels on which a freshly compiled kernel is checked against the eager one.
COMPILE_CHECK_PIXELS = 64


@dataclass
class _Compiled:
    """One process's compiled kernel of one prepared model (None: use eager)."""

    fn: Kernel | None = None
    checked: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


#: Compiled kernels of this process by prepared artifact key and device: tiles reuse them.
_COMPILED: OrderedDict[str, _Compiled] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
_COMPILED_MAX = 4


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only memory maps of the store: the kernels never write to their inputs.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _pixels_dynamic(*tensors: torch.Tensor | None) -> None:
    # Only the pixel dim varies between chunks and tiles: the model's own shapes stay
    # static, so the compiler generates kernels for them (all-dynamic shapes ran 4× slower).
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, t.ndim - 1)


def _host(outputs: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu").numpy() for k, v in outputs.items()}


def compiled_kernel(
    key: str,
    eager: Kernel,
    probe: tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None
    ],
    empty: Callable[[int], dict[str, torch.Tensor]],
    logger: logging.Logger,
) -> Kernel | None:
    """``eager`` compiled with torch.compile, once per process and ``key``; None when it cannot be.

    The first time, the compiled kernel is run on ``probe`` (params, buffers,
    x, target) and compared with ``eager`` under the agreement bound
    (``stages/engine/agreement.py``), and its finite flags, on the probe and
    on the probe with one pixel's input NaN, with numpy's ``isfinite`` of its
    outputs; a compile error or any disagreement is logged and the stage runs
    eager: the compiled path never changes results beyond what the bound
    allows, so it is not part of the cache key.
    """
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        if entry is None:
            entry = _COMPILED[key] = _Compiled()
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        _COMPILED.move_to_end(key)
    # Dynamo parses source with ast while it compiles: under the parse lock, or a tile
    # thread reading an array header meets CPython 3.11's unsafe ast constructor
    # (stages/engine/pyparse.py). A recompile later (a guard that fails) would parse
    # outside it; the pixel dimension is marked dynamic so that tile sizes do not.
    with entry.lock, PARSE_LOCK, part("setup"):  # compiling and its probe: setup
        if not entry.checked:
            entry.checked = True
            try:
                fn = torch.compile(eager)
                params, buffers, x, t = probe
                got, want = empty(int(x.shape[-1])), empty(int(x.shape[-1]))
                _pixels_dynamic(x, t, *got.values())
                flags = fn(params, buffers, x, t, got)
                eager(params, buffers, x, t, want)
                problems = disagreements(_host(got), _host(want))
                problems += _flag_problems(flags, got)
                fn = _nan_checked(fn, (params, buffers, x, t), got, problems, logger)
            except Exception as exc:
                logger.warning("model: torch.compile failed, running eager: %s", first_line(exc))
            else:
                if problems:
                    logger.warning(
                        "model: the compiled kernel disagrees with eager beyond the agreement "
                        "bound, running eager: %s",
                        "; ".join(problems),
                    )
                else:
                    entry.fn = fn
    return entry.fn


def _nan_checked(
    fn: Kernel,
    probe: tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None
    ],
    outputs: dict[str, torch.Tensor],
    problems: list[str],
    logger: logging.Logger,
) -> Kernel:
    """``fn``, its finite flags checked on a probe pixel with NaN input (into ``problems``).

    A NaN input makes most models' outputs not finite, and the flags must say
    so. Chunks come as views of the stored tile or as contiguous copies, which
    the compiler serves with a graph each: both are checked. A model that
    refuses NaN input leaves the flags unchecked: then ``fn``'s flags are
    dropped and the caller checks the outputs itself (slower, never wrong).
    """
    params, buffers, x, t = probe
    m = int(x.shape[-1])
    wide = torch.empty((*x.shape[:-1], 2 * m), dtype=x.dtype, device=x.device)[..., :m]
    try:
        for x_nan in (wide.copy_(x), x.clone(memory_format=torch.contiguous_format)):
            x_nan[..., 0] = float("nan")
            _pixels_dynamic(x_nan)
            problems += _flag_problems(fn(params, buffers, x_nan, t, outputs), outputs)
    except Exception as exc:
        logger.info(
            "model: the model refuses a NaN input (%s): the compiled kernel's outputs are "
            "checked for finite values separately",
            first_line(exc),
        )

        def without_flags(*args: Any) -> None:
            fn(*args)

        return without_flags
    return fn


def _flag_problems(flags: torch.Tensor | None, outputs: Mapping[str, torch.Tensor]) -> list[str]:
    """Where a compiled kernel's finite flags differ from numpy's isfinite on its outputs."""
    if flags is None:
        return []
    want = _finite_pixels(_host(outputs).values())
    wrong = int((flags.cpu().numpy() != want).sum())
    return [f"finite flags wrong at {wrong} of {want.size} pixels"] if wrong else []


def _finite_pixels(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """Whether each pixel (the last axis) has only finite values in all ``arrays``."""
    finite: np.ndarray | None = None
    for arr in arrays:
        ok = np.isfinite(arr.reshape(-1, arr.shape[-1])).all(axis=0)
        finite = ok if finite is None else finite & ok
    assert finite is not None, "a model has at least one output"
    return finite


def _forget_compiled(key: str | None = None) -> None:
    """Forget this process's compiled kernel of ``key`` (all of them with None)."""
    with _COMPILED_LOCK:
        if key is None:
            _COMPILED.clear()
        else:
            _COMPILED.pop(key, None)
