"""The nonlinear fit's batched Jacobian compiled (``solve.compile``), for a fixed number of rows.

Eager ``vmap(jacfwd(f))`` writes every intermediate of the forward-mode pass as a
(pixel × obs × param) tensor: on the double logistic of ``benchmarks/bench_curvefit.py``
(8,192 pixels × 50 dates × 4 parameters, float64, AMD EPYC, 2 cores) one chunk's
Jacobian took 23-26 ms eager and 1.3-1.5 ms compiled, where the model's values alone
take 1.1-1.5 ms. The compiled Jacobian is made by tracing the eager one to a graph of
aten operations (``make_fx``) and compiling that graph with inductor:
``torch.compile`` of ``jacfwd`` itself fails in torch 2.13 with an internal assert
(``_fw_primal`` under InferenceMode; pytorch/pytorch#151196, #160508), and so does a
trace with symbolic shapes. The graph therefore has one fixed number of rows: a
smaller batch is padded with copies of its last row (the padding's rows are
dropped), a larger one is cut into pieces.

Compiling costs 3-5 s per process (inductor's disk cache warm or cold; every worker
process pays it) and saves about 2.8 µs per pixel and Jacobian, about 5 Jacobians per
pixel on that cube: it breaks even near 250,000-400,000 pixels there, on a CPU;
``COMPILE_MIN_PIXELS`` (a million) leaves a margin for slower compiles, cheaper models
and pixels that stop sooner. A compiled Jacobian is
checked against the eager one on the rows it is first compiled for, under the
agreement bound (``stages/engine/agreement.py``), its non-finite entries included;
a compile error or a disagreement is logged and the fit runs eager. Results then
agree with an eager fit within that bound, not bit for bit, so ``compile`` is a
speed field, outside the cache key.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from gridsolve.schemas.errors import first_line
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.engine.pyparse import PARSE_LOCK
from gridsolve.stages.engine.timing import part
from gridsolve.stages.solve.levmar_problem import Rows

_log = logging.getLogger("gridsolve.solve")

#: ``compile: auto`` compiles the Jacobian for grids of at least this many pixels (see
#: the module's docstring). A pixel count, not a timing: the choice, and so the output's
#: bits, is the same on every run of one config.
COMPILE_MIN_PIXELS = 1_000_000

#: This process's compiled Jacobians by key, with the object they were compiled for
#: (kept alive, so that its id is never another's) and None where compiling failed
#: (run eager): the tiles of one stage and the repeats of one fit reuse them.
_COMPILED: OrderedDict[str, tuple[object, tuple[Rows, Rows] | None]] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
_COMPILED_MAX = 4


class FixedRows:
    """``compiled``, a function of exactly ``size`` rows, called on any number of rows.

    ``eager`` computes the same on any rows: when a call of ``compiled`` fails (out of
    memory on a device, a failing recompile), that is logged once and ``eager`` serves
    that call and every later one, of this function and of those it was linked with
    (:meth:`link`: a fit's two Jacobians).
    """

    def __init__(self, compiled: Rows, size: int, eager: Rows | None = None) -> None:
        self.compiled = compiled
        self.size, self.eager = size, eager
        self.failed = [False]  # shared by linked functions

    def link(self, other: FixedRows) -> None:
        """Fail over to eager together with ``other``."""
        self.failed = other.failed

    def __call__(self, u: torch.Tensor) -> torch.Tensor:
        """The function at every row of ``u``."""
        if self.failed[0] and self.eager is not None:
            return self.eager(u)
        try:
            return self._rows(u)
        except Exception as exc:
            if self.eager is None:
                raise
            self.failed[0] = True
            _log.warning(
                "solve: the compiled Jacobian failed during the fit, going on eager: %s",
                first_line(exc),
            )
            return self.eager(u)

    def _rows(self, u: torch.Tensor) -> torch.Tensor:
        fn = self.compiled
        k = int(u.shape[0])
        if k == self.size:
            return fn(u)
        if k > self.size:
            return torch.cat([self._rows(u[lo : lo + self.size]) for lo in range(0, k, self.size)])
        if k == 0:
            # no row to copy: one of zeros stands in, and none of the result is kept
            return self._rows(torch.zeros((1, *u.shape[1:]), dtype=u.dtype, device=u.device))[:0]
        pad = u[-1:].expand(self.size - k, *u.shape[1:])
        return fn(torch.cat([u, pad]))[:k]


def compile_rows(eager: Rows, example: torch.Tensor) -> Rows:
    """``eager`` traced and compiled for ``example``'s (rows, params), as :class:`FixedRows`.

    The result falls back to ``eager`` if a later call fails.
    """
    graph = make_fx(eager)(example)
    return FixedRows(torch.compile(graph, dynamic=False), int(example.shape[0]), eager)


def _check(compiled: Rows, eager: Rows, u: torch.Tensor) -> list[str]:
    """Where ``compiled`` disagrees with ``eager`` at ``u``, beyond the agreement bound.

    Each parameter's column is compared on its own scale; a Jacobian with no finite
    entry there cannot be checked, which counts as a disagreement.
    """
    # FixedRows' own path, which raises: its hand-over to eager is for the fit, not here
    call = compiled._rows if isinstance(compiled, FixedRows) else compiled
    got = call(u).detach().cpu().numpy()
    want = eager(u).detach().cpu().numpy()
    if not np.isfinite(want).any():
        return ["not finite anywhere it was checked: nothing to compare"]
    columns = range(want.shape[-1])
    return disagreements(
        {f"column {j}": got[..., j] for j in columns},
        {f"column {j}": want[..., j] for j in columns},
    )


def compiled_jacobians(
    key: str,
    owner: object,
    jacobian: Rows,
    jacobian_p: Rows,
    example: torch.Tensor,
    example_p: torch.Tensor,
    logger: logging.Logger,
) -> tuple[Rows, Rows] | None:
    """``(jacobian, jacobian_p)`` compiled for ``example``'s rows, once per process and ``key``.

    ``key`` names what the functions compute; an entry is reused only for the same
    ``owner`` too (None: the key alone decides).

    ``example`` (rows, params) holds internal parameters near the fit's start and
    ``example_p`` the same points as the model's parameters (what ``jacobian_p``
    reads): each compiled function is checked at its own and at a copy with one NaN.
    None (run eager) when compiling fails or disagrees; the reason is logged once.
    The caller holds the fit's lock: one compile of a key at a time.
    """
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        if entry is not None and entry[0] is owner:
            _COMPILED.move_to_end(key)
            return entry[1]
    # Dynamo parses source with ast while it compiles: under the parse lock (see
    # stages/engine/pyparse.py); the fit's own lock keeps tiles from compiling at once.
    with PARSE_LOCK, part("setup"):
        result: tuple[Rows, Rows] | None = None
        try:
            jac = compile_rows(jacobian, example)
            same = jacobian_p is jacobian
            jac_p = jac if same else compile_rows(jacobian_p, example_p)
            if isinstance(jac, FixedRows) and isinstance(jac_p, FixedRows):
                jac_p.link(jac)
            pairs = [("jacobian", jac, jacobian, example)]
            if not same:
                pairs.append(("jacobian_p", jac_p, jacobian_p, example_p))
            problems = []
            for what, fn, ref, at in pairs:
                nan = at.clone()
                nan[0, 0] = float("nan")
                problems += [f"{what}: {p}" for u in (at, nan) for p in _check(fn, ref, u)]
        except Exception as exc:  # any failure of the compiler: eager still works
            logger.warning(
                "solve: torch.compile of the Jacobian failed, running eager (to skip the "
                "attempt: solve.compile: never; compiling needs a C++ compiler, g++): %s",
                first_line(exc),
            )
        else:
            if problems:
                logger.warning(
                    "solve: the compiled Jacobian disagrees with eager beyond the agreement "
                    "bound, running eager (to skip the attempt: solve.compile: never): %s",
                    "; ".join(problems),
                )
            else:
                result = (jac, jac_p)
    with _COMPILED_LOCK:
        _COMPILED[key] = (owner, result)
        _COMPILED.move_to_end(key)
        while len(_COMPILED) > _COMPILED_MAX:
            _COMPILED.popitem(last=False)
    return result


def forget_compiled() -> None:
    """Drop this process's compiled Jacobians (tests and benchmarks start cold with it)."""
    with _COMPILED_LOCK:
        _COMPILED.clear()
