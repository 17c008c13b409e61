"""Gap patterns: which observations of a pixel are valid, hashed to one number per pixel.

The load stage counts the patterns of the whole grid once; the solve stage
gives a pattern its own shared factorisation when at least
:data:`GROUP_MIN` pixels of the *grid* have it (a time step missing
everywhere, a recurring cloud mask). Deciding from grid-wide counts, not from
the pixels of one tile, keeps every pixel's result independent of the tiling.
"""

from __future__ import annotations

import functools

import numpy as np

#: Pixels that must share a gap pattern before it gets its own factorisation.
GROUP_MIN = 32
#: Most patterns remembered (the most common); the rest are solved per pixel.
MAX_PATTERNS = 4096
_MULT = np.uint64(0x9E3779B97F4A7C15)
_SEED = np.uint64(0x243F6A8885A308D3)


def full_hash(n_obs: int) -> np.uint64:
    """The hash of the pattern in which all ``n_obs`` observations are valid."""
    return np.uint64(pattern_hash(np.ones((n_obs, 1), dtype=bool))[0])


def pattern_hash(valid: np.ndarray) -> np.ndarray:
    """64-bit hash of each pixel's validity pattern; ``valid`` is (obs, ...)."""
    h = np.full(valid.shape[1:], _SEED, dtype=np.uint64)
    extend(h, valid)
    return h


def extend(h: np.ndarray, valid: np.ndarray) -> None:
    """Fold more observations (in order) into running hashes ``h``, in place.

    Each observation is ``h = h·M + valid + 1`` (mod 2⁶⁴).
    """
    # The + 1 of the n steps adds up to Σ_{j<n} Mʲ whatever the values: added once at
    # the end (half the passes over h, and no converted copy of each row).
    with np.errstate(over="ignore"):
        for row in valid:
            np.multiply(h, _MULT, out=h)
            np.add(h, row, out=h, casting="unsafe")  # bool: 0 or 1
        h += _ones(len(valid))


@functools.cache
def _ones(n: int) -> np.uint64:
    """``Σ_{j<n} M^j`` mod 2⁶⁴: what ``n`` steps' ``+ 1`` add to a running hash."""
    m, mod = int(_MULT), 2**64
    return np.uint64(sum(pow(m, j, mod) for j in range(n)) % mod)


def common_patterns(h: np.ndarray, full: np.uint64) -> np.ndarray:
    """Hashes shared by ≥ GROUP_MIN pixels (not the fully valid one), the most common kept."""
    values, counts = np.unique(h.ravel(), return_counts=True)
    keep = (counts >= GROUP_MIN) & (values != full)
    values, counts = values[keep], counts[keep]
    order = np.argsort(-counts, kind="stable")[:MAX_PATTERNS]
    return np.sort(values[order])


class GridPatterns:
    """Pattern hashes of a whole grid, built from blocks streamed along any one dim."""

    def __init__(self, dims: tuple[str, ...], obs_dim: str, sizes: dict[str, int]) -> None:
        self.dims = dims
        self.obs_dim = obs_dim
        self.order = [dims.index(obs_dim)] + [i for i, d in enumerate(dims) if d != obs_dim]
        spatial = [sizes[d] for d in dims if d != obs_dim]
        self.h = np.full(spatial, _SEED, dtype=np.uint64)
        self.full = full_hash(sizes[obs_dim])

    def update(self, block: np.ndarray, start: int, finite: np.ndarray | None = None) -> None:
        """Fold a block of the variable (sliced along its first dim from ``start``) in.

        ``finite``: ``np.isfinite(block)``, where the caller has it already.
        """
        valid = (np.isfinite(block) if finite is None else finite).transpose(self.order)
        if self.dims[0] == self.obs_dim:
            extend(self.h, valid)
        else:
            n = valid.shape[1]
            sub = np.full(valid.shape[1:], _SEED, dtype=np.uint64)
            extend(sub, valid)
            # the block's first dim is the first spatial dim of h
            self.h[start : start + n] = sub

    def common(self) -> np.ndarray:
        """The grid's common gap patterns (see :func:`common_patterns`)."""
        return common_patterns(self.h, self.full)
