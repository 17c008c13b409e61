"""Compiled per-pixel kernels of the per-pixel solve (CPU, float64).

What they do (each replaces an eager function of :mod:`~gridsolve.stages.solve.linalg`):

* ``gs_cholesky``, ``gs_solve``, ``gs_spread``: the packed Cholesky factor of every
  pixel's normal equations, its solves, and the spread ``Z = L⁻¹T`` with
  ``diag(ZᵀZ)`` (:func:`linalg.packed_cholesky`, :meth:`linalg.PackedFactor.solve_`,
  :func:`spread._primal_spread`). In torch these are a loop over the matrix order of
  elementwise operations on (·, pixels) arrays: hundreds of operations per batch, each
  a pass through memory. Here the pixels are the innermost loop, 64 at a time, so a
  block's factors stay in the L1 cache. ``gs_cholesky`` also solves the first
  right-hand side (``rhs=``) and, when only the variances are wanted, computes
  them (``spread=``) block by block as it factors, instead of further reads of
  every factor.
* ``gs_moments``: the residual RMS of every pixel and the moments of the uncertainty
  option (weighted residual RMS, RMS about the weighted mean, uncentred RMS), in one
  read of the batch's data instead of a product, a mask and a pairwise sum each
  (:func:`linalg.residual_moments`).

* ``gs_fit``: all of the above for the usual case, unit weights (the data's missing
  values) in the primal form without ridge (:func:`linalg.fit_unit`): each pixel's
  data read once, its Gram matrix, factor, solve, refinement, residual sums and
  variances in registers, instead of the separate passes over float64 copies of the
  batch, which are bound by memory.
* ``gs_step``: a refinement step's correction and convergence test (:func:`cholesky._step`).
* ``gs_load``, ``gs_statistics``, ``gs_gap_factor``, ``gs_gap_solve``: a batch's data as
  float64 (and its 0/1 weights), the uncertainty's statistics straight into the outputs,
  and the gap-wise dual's gather-and-factor and gather-solve-scatter.

The refinement's residuals stay torch's: they are matrix products, which MKL does
with fused multiply-adds; a compiled per-pixel loop without them is compute-bound
and no faster (measured on this project's machine: 1.2-1.4 ms against 1.1 ms per
batch of 16,384 pixels).

The eager functions stay the reference and the fallback (no C compiler, a device
other than the CPU, or ``GRIDSOLVE_SOLVE_KERNEL=eager``). Both are free of fused
multiply-adds (``-ffp-contract=off``), but they round differently (the kernel
multiplies by reciprocal square roots, sums residuals in row order), so they are
held, like any CPU code path, to the agreement bound of
:mod:`gridsolve.stages.engine.agreement` (tests/stages/test_kernel.py) and which
one ran is not part of a cache key. Every kernel works pixel by pixel: its result
for a pixel depends on that pixel's inputs alone, never on the other pixels of the
batch or on how they are shared out over threads (the matrix products that feed it
are MKL's, which round by the batch's width as the bound allows).

The C lives in ``csrc/`` beside this module: ``gs_kernels.c`` (the translation unit),
``gs_kernels.h`` (the functions called through ctypes; tests/stages/test_kernel_source.py
checks :func:`_bind`'s signatures against it, and CI compiles the library with
``-Wall -Wextra -Werror``) and ``gs_vector.h`` (the vector kernels, included once per
instruction set). They are part of the solve stage's code digest (:data:`CODE_FILES`):
editing them invalidates cached solves. The library is built on first use rather than
at install: it is specific to the machine's compiler, and a pure-Python wheel stays
one wheel for every CPU (``.ci/install`` and the Docker image build it once).

The library (x86-64 Linux only; elsewhere the eager path runs) is built on first use
(about 25 s, once per machine and compiler) with the system's C compiler (``$CC``,
which may carry arguments, else ``cc``/``gcc``) into ``$GRIDSOLVE_KERNEL_DIR``
(default ``~/.cache/gridsolve/kernels``; if that cannot be written, a folder of the
temporary directory that only this user can write to), named by a digest of the
sources, the flags, the compiler and its version; processes that build at once (Dask
workers) each write a temporary file and rename it. It holds AVX-512, AVX2 and SSE2 versions and
picks one by the CPU it runs on; none uses fused multiply-adds, so they round alike.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from gridsolve.stages.engine.timing import part

#: Choice of kernel: ``auto`` (C where it builds, else eager), ``c`` (C, or an
#: error saying why it cannot be built), ``eager`` (torch only).
ENV = "GRIDSOLVE_SOLVE_KERNEL"
#: Where built libraries are kept.
DIR_ENV = "GRIDSOLVE_KERNEL_DIR"
#: Pixels per block: a coef-10 factor block (55 × 64 doubles) fits the L1 cache.
BLOCK = 64
#: Fewest pixels per thread: handing a range to the pool costs about as much as
#: factoring a few hundred pixels (the dual's gap groups are often that small).
MIN_PART = 2048
#: The most gaps per pixel that :func:`gap_solve` takes.
MAX_GAPS = 64
#: The largest order (coefficients) that the residual kernel takes:
#: they keep a pixel's coefficients in registers.
MAX_ORDER = 16

#: The C sources, in ``csrc/`` beside this module (``gs_kernels.c`` is the translation
#: unit; it includes the others). Listed here so that the solve stage's code digest
#: covers them (``stages/engine/versions.py``).
CODE_FILES = ("csrc/gs_kernels.c", "csrc/gs_kernels.h", "csrc/gs_vector.h")
CSRC = Path(__file__).with_name("csrc")
#: The translation unit the library is built from.
MAIN_SOURCE = CSRC / "gs_kernels.c"


def source_text() -> str:
    """Every C source file's text, in :data:`CODE_FILES` order (what the library's name digests)."""
    return "\0".join((Path(__file__).parent / f).read_text() for f in CODE_FILES)


#: Flags: no fused multiply-adds (the eager path has none; every clone rounds
#: alike); math-errno off so that sqrt vectorises (it changes no value).
FLAGS = (
    "-O3",
    "-std=gnu99",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-Wno-psabi",
)

#: Wall-clock limit of one compiler run: the compiler never waits on input, so this
#: only guards against a wedged toolchain, never against a slow, shared machine.
BUILD_TIMEOUT_S = 1800

_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


class KernelUnavailable(RuntimeError):
    """The compiled kernel was required (``GRIDSOLVE_SOLVE_KERNEL=c``) but cannot be built."""


def choice() -> str:
    """The requested kernel (``auto``, ``c`` or ``eager``), checked."""
    how = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if how not in ("auto", "c", "eager"):
        raise ValueError(f"{ENV}={how!r} is not a kernel: set it to auto, c or eager")
    return how


def _compiler() -> list[str] | None:
    """The C compiler's command (``$CC`` may carry arguments: ``ccache gcc``), or None."""
    cc = shlex.split(os.environ.get("CC", ""))
    if cc:
        found = shutil.which(cc[0]) or (cc[0] if os.path.isfile(cc[0]) else None)
        return [found, *cc[1:]] if found else None
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _private_tmp() -> Path:
    """A build folder under the temporary directory that only this user can write to."""
    where = Path(tempfile.gettempdir()) / f"gridsolve-kernels-{os.getuid()}"
    where.mkdir(mode=0o700, exist_ok=True)
    st = where.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077 or where.is_symlink():
        # someone else's, or open to others: a library found there could be anyone's
        return Path(tempfile.mkdtemp(prefix="gridsolve-kernels-"))
    return where


def _cache_dir() -> Path:
    given = os.environ.get(DIR_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gridsolve" / "kernels"


def _build(cc: list[str], where: Path) -> Path:
    """The library for this source, flags and compiler: built into ``where`` unless there."""
    version = subprocess.run(
        [*cc, "--version"], capture_output=True, text=True, timeout=30, check=False
    ).stdout
    parts = [source_text(), *FLAGS, *cc, version, platform.machine()]
    tag = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:20]
    lib = where / f"gridsolve-solve-{tag}.so"
    if lib.is_file():
        return lib
    where.mkdir(parents=True, exist_ok=True)
    errors = []
    with tempfile.TemporaryDirectory(dir=where) as tmp:
        src = MAIN_SOURCE
        out = Path(tmp) / "kernel.so"
        # function clones per instruction set where the compiler has them (GCC on glibc)
        for extra in (["-DGS_CLONES"], []):
            done = subprocess.run(
                [*cc, *FLAGS, *extra, str(src), "-o", str(out), "-lm"],
                capture_output=True,
                text=True,
                # 25 s of CPU on a quiet host, but over 2 min of wall time on a loaded
                # 2-core one (measured: 2m04 beside three busy jobs); a tight limit made
                # the build time out there and the run fall back to the eager path
                timeout=BUILD_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0:
                # a rename: concurrent builders (Dask workers) never see a partial file
                os.replace(out, lib)
                return lib
            errors.append(done.stderr.strip())
    raise OSError(f"{cc} failed: {errors[-1][-2000:]}")


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    L, D, V = ctypes.c_long, ctypes.c_double, ctypes.c_void_p
    lib.gs_cholesky.argtypes = [L, L, L, V, V, D, V, V, V, L, L]
    lib.gs_cholesky.restype = ctypes.c_int
    lib.gs_solve.argtypes = [L, L, L, V, V, L, L]
    lib.gs_solve.restype = None
    lib.gs_spread.argtypes = [L, L, V, V, V, V, L, L]
    lib.gs_spread.restype = ctypes.c_int
    lib.gs_statistics.argtypes = [L, V, L, V, V, V, V, V, L, V, L, L, V, ctypes.c_byte]
    lib.gs_statistics.argtypes += [V, L, V, V, V, L, L]
    lib.gs_statistics.restype = None
    for fn in (lib.gs_load_f32, lib.gs_load_f64):
        fn.argtypes = [L, L, V, L, V, V, L, L]
        fn.restype = None
    lib.gs_spread_var.argtypes = [L, L, V, V, V, L, L]
    lib.gs_spread_var.restype = ctypes.c_int
    lib.gs_use_isa.argtypes = [ctypes.c_int]
    lib.gs_use_isa.restype = ctypes.c_int
    lib.gs_step.argtypes = [L, L, V, V, V, V, V, D, L, L]
    lib.gs_step.restype = None
    lib.gs_gap_solve.argtypes = [L, L, V, V, V, V, L, L, L, L]
    lib.gs_gap_solve.restype = None
    lib.gs_gap_factor.argtypes = [L, L, V, L, V, V, V, D, L, L]
    lib.gs_gap_factor.restype = ctypes.c_int
    lib.gs_moments.argtypes = [L, L, L, V, V, V, V, L, V, V, V, V, L, L]
    lib.gs_moments.restype = ctypes.c_int
    lib.gs_fit.argtypes = [L, L, L, V, L, L, V, V, V, V, D, D, L, L, V, V, V, V, V, L, L]
    lib.gs_fit.restype = ctypes.c_int
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    with part("setup"):  # once per process: the run summary counts it as setup
        return _find_library()


def _find_library() -> ctypes.CDLL | None:
    how = choice()
    if how == "eager":
        return None
    cc = _compiler()
    problem = "no C compiler found (set CC, or install gcc)" if cc is None else ""
    if platform.machine().lower() not in ("x86_64", "amd64") or not sys.platform.startswith(
        "linux"
    ):
        # its vector code is written for x86-64 (AVX-512, AVX2, SSE2) and 64-bit longs
        cc, problem = None, f"written for x86-64 Linux, not {platform.machine()} {sys.platform}"
    if cc is not None:
        for place in (_cache_dir, _private_tmp):
            try:
                return _bind(ctypes.CDLL(str(_build(cc, place()))))
            except (OSError, subprocess.SubprocessError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
    if how == "c":
        raise KernelUnavailable(
            f"{ENV}=c, but the solve kernel cannot be built: {problem}. "
            f"Install a C compiler, or set {ENV}=auto to use the eager path."
        )
    warnings.warn(
        f"the compiled solve kernel is unavailable ({problem}); using the eager torch path "
        "(same results within the agreement bound, slower)",
        RuntimeWarning,
        stacklevel=3,
    )
    return None


def _loaded() -> ctypes.CDLL:
    """The library, for the wrappers below (their callers checked :func:`usable`)."""
    lib = _library()
    if lib is None:
        raise KernelUnavailable(f"the solve kernel is not loaded ({ENV}={choice()})")
    return lib


def use_isa(limit: int) -> int:
    """Cap the register kernels' vector version; the one now used (3 AVX-512, 2 AVX2, 1 SSE2).

    For tests, which run every version on one machine.
    """
    lib = _loaded()
    return int(lib.gs_use_isa(int(limit)))


def name() -> str:
    """Which kernel the per-pixel solve uses on CPU tensors: ``c`` or ``eager``."""
    return "eager" if _library() is None else "c"


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the compiled kernel can take these tensors (contiguous float64 on the CPU)."""
    if not all(
        t.device.type == "cpu" and t.dtype == torch.float64 and t.is_contiguous() for t in tensors
    ):
        return False
    return _library() is not None


def _parts(p: int) -> list[tuple[int, int]]:
    """Pixel ranges for torch's threads, in whole blocks, at least :data:`MIN_PART` pixels each."""
    if p <= 0:
        return []
    threads = max(1, min(torch.get_num_threads(), p // MIN_PART))
    step = math.ceil(math.ceil(p / threads) / BLOCK) * BLOCK
    return [(s, min(s + step, p)) for s in range(0, p, step)]


def _run(fn: Callable[..., object], args: tuple[object, ...], p: int) -> None:
    """``fn(*args, p0, p1)`` over the pixel ranges, in parallel (ctypes releases the GIL)."""
    global _POOL
    parts = _parts(p)
    if not parts:
        return
    if len(parts) == 1:
        results = [fn(*args, 0, p)]
    else:
        with _LOCK:
            if _POOL is None:
                _POOL = concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1, "gs-kernel")
        results = list(_POOL.map(lambda r: fn(*args, *r), parts))
    if any(r is not None and r != 0 for r in results):
        raise MemoryError("the solve kernel could not allocate its scratch")


def cholesky(
    G: torch.Tensor,
    n: int,
    tol: float,
    square: bool = False,
    spread: tuple[torch.Tensor | None, torch.Tensor] | None = None,
    rhs: torch.Tensor | None = None,
) -> torch.Tensor:
    """``G`` factored in place by the kernel; which pixels factored well.

    :func:`linalg.packed_cholesky`, or with ``square`` (G: n × n × P)
    :func:`linalg.batched_cholesky`. In the same pass over the factor:
    ``spread``: ``(T, var)``, and ``var`` (n, P) is filled as by :func:`spread`
    (packed, n ≤ :data:`MAX_ORDER`); ``rhs`` (n, P) is solved in place as by
    :func:`solve_`.
    """
    lib = _loaded()
    p = G.shape[-1]
    ok = torch.empty(p, dtype=torch.bool)
    if rhs is not None and not (rhs.shape == (n, p) and usable(rhs)):
        raise ValueError("the fused solve's right-hand side must be contiguous float64 (n, P)")
    hp = None if rhs is None else rhs.data_ptr()
    tp = vp = None
    if spread is not None:
        T, var = spread
        if square or not 1 <= n <= MAX_ORDER or var.shape != (n, p) or not usable(var):
            raise ValueError("the fused spread takes a packed factor of at most 16 columns")
        tp = None if T is None else T.data_ptr()
        vp = var.data_ptr()
        if T is not None and not (usable(T) and T.shape == (n, n)):
            raise ValueError("the fused spread's T must be a contiguous float64 n × n matrix")
    _run(lib.gs_cholesky, (n, int(square), p, G.data_ptr(), ok.data_ptr(), tol, tp, vp, hp), p)
    return ok


def solve_(G: torch.Tensor, n: int, h: torch.Tensor, square: bool = False) -> torch.Tensor:
    """``h`` (n, P) solved in place by the kernel.

    :meth:`linalg.PackedFactor.solve_`, or with ``square`` :func:`linalg.cholesky_solve`.
    """
    lib = _loaded()
    _run(lib.gs_solve, (n, int(square), h.shape[1], G.data_ptr(), h.data_ptr()), h.shape[1])
    return h


def step(
    x: torch.Tensor, dx: torch.Tensor, ok: torch.Tensor, conv: torch.Tensor | None, tol: float
) -> torch.Tensor:
    """:func:`cholesky._step` for one pair, ``x`` corrected in place; which pixels converged."""
    lib = _loaded()
    n, p = x.shape
    flags = [ok] if conv is None else [ok, conv]
    if dx.shape != x.shape or not all(
        f.shape == (p,) and f.dtype == torch.bool and f.is_contiguous() for f in flags
    ):
        raise ValueError("step: x and dx (n, P), ok and conv (P,) contiguous bool")
    out = torch.empty(p, dtype=torch.bool)
    cp = None if conv is None else conv.data_ptr()
    args = (n, p, x.data_ptr(), dx.data_ptr(), ok.data_ptr(), cp, out.data_ptr(), tol)
    _run(lib.gs_step, args, p)
    return out


def gap_solve(
    L: torch.Tensor, rows: torch.Tensor, u: torch.Tensor, Z: torch.Tensor, a: int
) -> None:
    """:func:`dual._dual_schur`'s solve of one gap group, gathering and scattering in one pass.

    For the group's pixels (columns ``a`` on of ``u`` and ``Z``, both contiguous):
    ``Z[rows] = (L Lᵀ)⁻¹ u[rows]``; ``L`` (k, k, n), ``rows`` (k, n) int64.
    """
    lib = _loaded()
    k, n = rows.shape
    if not (
        rows.dtype == torch.int64
        and L.shape == (k, k, n)
        and u.shape == Z.shape
        and a + n <= u.shape[1]
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (L, rows, u, Z))
        and L.dtype == u.dtype == Z.dtype == torch.float64
    ):
        raise ValueError("gap_solve: L (k, k, n), rows (k, n) int64, u and Z contiguous float64")
    args = (k, n, L.data_ptr(), rows.data_ptr(), u.data_ptr(), Z.data_ptr(), u.shape[1], a)
    _run(lib.gs_gap_solve, args, n)


def gap_factor(
    H: torch.Tensor, rows: torch.Tensor, tol: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dual._gap_groups`' factors of one gap group, gathered from ``H`` and factored.

    ``H`` (m, m), ``rows`` (k, n) int64 in ``[0, m)``: the square factors (k, k, n) of
    ``H[rows[:, None], rows[None]]`` as :func:`cholesky` with ``square`` makes them, and
    which pixels factored well.
    """
    lib = _loaded()
    k, n = rows.shape
    m = H.shape[0]
    if not (
        rows.dtype == torch.int64
        and H.shape == (m, m)
        and H.dtype == torch.float64
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (H, rows))
    ):
        raise ValueError("gap_factor: H (m, m) contiguous float64, rows (k, n) contiguous int64")
    if rows.numel():
        lo, hi = torch.aminmax(rows)
        if int(lo) < 0 or int(hi) >= m:
            raise ValueError("gap_factor: rows must index H")
    L = torch.empty((k, k, n), dtype=torch.float64)
    ok = torch.empty(n, dtype=torch.bool)
    args = (k, n, H.data_ptr(), m, rows.data_ptr(), L.data_ptr(), ok.data_ptr(), tol)
    _run(lib.gs_gap_factor, args, n)
    return L, ok


def _rows(a: np.ndarray, dtype: type) -> int:
    """The row stride, in elements, of a 2-D array whose rows are contiguous."""
    if (
        a.dtype != dtype
        or a.ndim != 2
        or not rows_contiguous(a)
        or a.strides[0] < 0
        or (a.shape[0] > 1 and a.strides[0] == 0)
    ):
        raise ValueError(f"expected a 2-D {np.dtype(dtype)} array with contiguous rows")
    return a.strides[0] // a.itemsize


def statistics(
    C: np.ndarray,
    status: np.ndarray,
    n_valid: np.ndarray,
    wrms: np.ndarray,
    trms: np.ndarray,
    var: np.ndarray,
    edf: np.ndarray,
    ridge: bool,
    scaled: bool,
    ok_codes: tuple[int, int, int, int],
    fell_back_ridge: int,
    out: dict[str, np.ndarray],
) -> None:
    """:func:`uncertainty._statistics` (without covariance) of P pixels, into ``out``'s arrays.

    ``C``, ``var`` (coef, P) float64 and ``out``'s ``coef_stderr`` (coef, P) float64
    may be views whose rows are not adjacent; ``status`` (P,) int8,
    ``n_valid`` int32, ``wrms``, ``trms``, ``edf`` float64 and ``out``'s ``dof``,
    ``r2`` (float64) and ``uncertainty_flags`` (int8) are contiguous.
    """
    lib = _loaded()
    p = C.shape[1]
    se = out["coef_stderr"]
    # checked here, not asserted: they guard raw pointers (python -O drops asserts)
    if C.shape != se.shape or var.shape != C.shape:
        raise ValueError("statistics: C, var and the stderr output must share a shape")
    vectors = [status, n_valid, wrms, trms, edf, out["dof"], out["r2"], out["uncertainty_flags"]]
    if not all(v.flags.c_contiguous and v.shape == (p,) for v in vectors):
        raise ValueError("statistics: the per-pixel vectors must be contiguous, one per pixel")
    if status.dtype != np.int8 or n_valid.dtype != np.int32:
        raise ValueError("statistics: status must be int8 and n_valid int32")
    if out["uncertainty_flags"].dtype != np.int8 or not all(
        a.dtype == np.float64 for a in (wrms, trms, edf, out["dof"], out["r2"])
    ):
        raise ValueError("statistics: flags must be int8 and the other vectors float64")
    codes = np.asarray(ok_codes, dtype=np.int8)
    args = (
        C.shape[0],
        C.ctypes.data,
        _rows(C, np.float64),
        status.ctypes.data,
        n_valid.ctypes.data,
        wrms.ctypes.data,
        trms.ctypes.data,
        var.ctypes.data,
        _rows(var, np.float64),
        edf.ctypes.data,
        int(ridge),
        int(scaled),
        codes.ctypes.data,
        fell_back_ridge,
        se.ctypes.data,
        _rows(se, np.float64),
        out["dof"].ctypes.data,
        out["r2"].ctypes.data,
        out["uncertainty_flags"].ctypes.data,
    )
    _run(lib.gs_statistics, args, p)


def spread(
    G: torch.Tensor, n: int, T: torch.Tensor | None, want_z: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``diag(ZᵀZ)`` (n, P) for ``Z = L⁻¹T`` per pixel, and ``Z`` (n, n, P) when asked."""
    lib = _loaded()
    p = G.shape[1]
    var = torch.empty((n, p), dtype=torch.float64)
    Z = torch.empty((n, n, p), dtype=torch.float64) if want_z else None
    Tc = None if T is None else T.to(torch.float64).contiguous()
    if Z is None and 1 <= n <= MAX_ORDER:  # the variances only: the register kernel
        tp = None if Tc is None else Tc.data_ptr()
        _run(lib.gs_spread_var, (n, p, G.data_ptr(), tp, var.data_ptr()), p)
        return var, None
    _run(
        lib.gs_spread,
        (
            n,
            p,
            G.data_ptr(),
            None if Tc is None else Tc.data_ptr(),
            None if Z is None else Z.data_ptr(),
            var.data_ptr(),
        ),
        p,
    )
    return var, Z


def rows_contiguous(a: np.ndarray) -> bool:
    """Each row's elements adjacent (one column: whatever numpy says its stride is)."""
    return a.shape[1] == 1 or a.strides[1] == a.itemsize


def load(src: np.ndarray, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``src`` (m, P) as float64 with NaN and ±inf as 0; None where the kernel cannot take it.

    With ``finite``, also where ``src`` is finite, as 0/1 floats. ``src``: float32 or
    float64 rows, each contiguous, any row stride (a column slice).
    """
    lib = _library()
    fn = {np.dtype(np.float32): "gs_load_f32", np.dtype(np.float64): "gs_load_f64"}
    name = fn.get(src.dtype)
    if lib is None or name is None or src.ndim != 2 or not rows_contiguous(src):
        return None
    if src.strides[0] % src.itemsize:
        return None
    m, p = src.shape
    B0 = torch.from_numpy(np.empty((m, p)))
    W = torch.from_numpy(np.empty((m, p))) if finite else None
    wp = None if W is None else W.data_ptr()
    args = (m, p, src.ctypes.data, src.strides[0] // src.itemsize, B0.data_ptr(), wp)
    _run(getattr(lib, name), args, p)
    return B0, W


def moments(
    A: torch.Tensor,
    B0: torch.Tensor,
    W: torch.Tensor,
    x: torch.Tensor,
    full: bool = True,
    centred_only: bool = False,
) -> torch.Tensor:
    """Per pixel, sums in row order of ``r = B0 − A x`` with weights ``W`` (> 0: valid rows).

    Rows of the (4, P) result: ``Σ r²`` over the valid rows and, with ``full``
    (else zeros), ``Σ W r²``, ``Σ W (b − b̄)²`` about the weighted mean ``b̄``, and
    ``Σ W b²``; with ``centred_only`` too, the second and fourth are zeros (not
    computed). ``A`` has at most :data:`MAX_ORDER` columns.
    """
    lib = _loaded()
    m, n = A.shape
    p = x.shape[1]
    Ac = A.contiguous()
    out = torch.empty((4, p), dtype=torch.float64)
    ptrs = [out[i].data_ptr() for i in range(4)]
    how = 0 if not full else 2 if centred_only else 1
    _run(
        lib.gs_moments,
        (n, m, p, Ac.data_ptr(), B0.data_ptr(), W.data_ptr(), x.data_ptr(), how, *ptrs),
        p,
    )
    return out


def fit(
    src: np.ndarray,
    Q: torch.Tensor,
    pairs: torch.Tensor,
    A: torch.Tensor,
    Rinv: torch.Tensor | None,
    tol: float,
    refine_tol: float,
    steps: int,
    want: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The per-pixel primal fit of every column of ``src`` (m, P) with its 0/1 mask as weights.

    :func:`linalg.fit_unit`'s kernel. ``src``: float32 or float64 rows, each contiguous
    (a column slice of the data); NaN and ±inf are invalid rows. ``Q`` (m, n) the design's
    basis, ``pairs`` its packed Gram rows (n(n+1)/2, m), ``A`` (m, n) the design,
    ``Rinv`` (n, n) the coefficients' change of basis (None: ``Q`` is ``A``). Returns the
    coefficients (n, P), which pixels factored and converged, the sum of squared
    residuals over valid rows and, with ``want``, the variances ``diag(ZᵀZ)`` (n, P) of
    ``Z = L⁻¹R⁻ᵀ`` and the sum of squares about the mean.
    """
    lib = _loaded()
    m, p = src.shape
    n = A.shape[1]
    if src.dtype not in (np.float32, np.float64) or src.ndim != 2 or p == 0:
        raise ValueError("fit: src must be a non-empty 2-D float32 or float64 array")
    if not rows_contiguous(src) or src.strides[0] % src.itemsize or src.strides[0] < 0:
        raise ValueError("fit: src's rows must each be contiguous")
    mats = [Q, pairs, A] + ([] if Rinv is None else [Rinv])
    shapes = [(m, n), (n * (n + 1) // 2, m), (m, n)] + ([] if Rinv is None else [(n, n)])
    if not 1 <= n <= MAX_ORDER or any(
        t.shape != s or not usable(t) for t, s in zip(mats, shapes, strict=True)
    ):
        raise ValueError("fit: Q, A (m, n ≤ 16), pairs and Rinv contiguous float64 on the CPU")
    T = None if Rinv is None else Rinv.T.contiguous()  # the kernels' spread takes R⁻ᵀ
    x = torch.empty((n, p), dtype=torch.float64)
    good = torch.empty(p, dtype=torch.bool)
    ss = torch.empty(p, dtype=torch.float64)
    var = torch.empty((n, p), dtype=torch.float64) if want else None
    tss = torch.empty(p, dtype=torch.float64) if want else None
    args = (
        n,
        m,
        p,
        src.ctypes.data,
        src.strides[0] // src.itemsize,
        int(src.dtype == np.float64),
        Q.data_ptr(),
        pairs.data_ptr(),
        A.data_ptr(),
        None if T is None else T.data_ptr(),
        tol,
        refine_tol,
        steps,
        int(want),
        x.data_ptr(),
        good.data_ptr(),
        ss.data_ptr(),
        None if var is None else var.data_ptr(),
        None if tss is None else tss.data_ptr(),
    )
    _run(lib.gs_fit, args, p)
    return x, good, ss, var, tss
