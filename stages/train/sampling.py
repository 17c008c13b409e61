"""Which pixels train and validate, which pixels each step draws, and what that costs in privacy.

The validation pixels are held out in square blocks (:func:`block_split`); each epoch
shuffles the training pixels into minibatches, or with DP noise draws them by Poisson
sampling (:func:`epoch_batches`); :func:`epsilon` is the RDP accounting of the latter.
All randomness of epoch ``e`` comes from generators seeded with ``(seed, stream, e)``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.train import GradientTrain

# Independent random streams, each seeded with (seed, stream, epoch).
_SPLIT_STREAM = 0
_SAMPLE_STREAM = 1
_NOISE_STREAM = 2


# ---------------------------------------------------------------- split and sampling
#: Side in pixels of the square blocks the validation pixels are held out in.
VALIDATION_BLOCK = 8


def block_split(
    ny: int, nx: int, fraction: float, seed: int, block: int = VALIDATION_BLOCK
) -> np.ndarray:
    """Validation mask (ny, nx): True on whole ``block``×``block`` blocks of a fixed grid.

    About ``fraction`` of the blocks (at least one when ``fraction`` > 0, and
    never all of them when there are two or more) are chosen at random with a
    generator seeded by ``seed``. The grid starts at pixel (0, 0), so the mask
    depends on the grid's shape and the seed only, never on the tiling.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}")
    nby, nbx = -(-ny // block), -(-nx // block)
    n_blocks = nby * nbx
    k = round(fraction * n_blocks)
    if fraction > 0 and n_blocks > 0:
        k = max(k, 1)
        if n_blocks > 1:
            k = min(k, n_blocks - 1)
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SPLIT_STREAM]))
    chosen = np.zeros(n_blocks, dtype=bool)
    chosen[rng.permutation(n_blocks)[:k]] = True
    grid = chosen.reshape(nby, nbx)
    mask: np.ndarray = np.repeat(np.repeat(grid, block, axis=0), block, axis=1)[:ny, :nx]
    return np.ascontiguousarray(mask)


def sample_rate(batch_pixels: int, n_pixels: int) -> float:
    """Probability q that Poisson sampling includes a pixel in a step."""
    return min(1.0, batch_pixels / n_pixels)


def steps_per_epoch(batch_pixels: int, n_pixels: int) -> int:
    """Optimiser steps per epoch: ceil(N / batch_pixels)."""
    return -(-n_pixels // batch_pixels)


def expected_batch(batch_pixels: int, n_pixels: int) -> int:
    """The divisor of the noisy gradient sum under Poisson sampling: q·N."""
    return min(batch_pixels, n_pixels)


def _epoch_seed(seed: int, stream: int, epoch: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([seed, stream, epoch])


def epoch_batches(
    n_pixels: int, batch_pixels: int, poisson: bool, seed: int, epoch: int
) -> Iterator[np.ndarray]:
    """The sorted pixel indices of each step of epoch ``epoch`` (1-based).

    Shuffled consecutive minibatches, or with ``poisson`` independent Poisson
    draws (possibly empty), from a generator seeded with ``(seed, epoch)``.
    """
    rng = np.random.default_rng(_epoch_seed(seed, _SAMPLE_STREAM, epoch))
    if not poisson:
        order = rng.permutation(n_pixels)
        for start in range(0, n_pixels, batch_pixels):
            yield np.sort(order[start : start + batch_pixels])
        return
    q = sample_rate(batch_pixels, n_pixels)
    for _ in range(steps_per_epoch(batch_pixels, n_pixels)):
        # A binomial size, then a uniform subset of it: the same law as one coin per pixel,
        # at a cost proportional to the batch rather than to N.
        k = int(rng.binomial(n_pixels, q))
        yield np.sort(rng.choice(n_pixels, size=k, replace=False, shuffle=False))


def _noise_generator(seed: int, epoch: int, device: torch.device) -> torch.Generator:
    state = _epoch_seed(seed, _NOISE_STREAM, epoch).generate_state(1, np.uint64)
    return torch.Generator(device=device).manual_seed(int(state[0]))


# ---------------------------------------------------------------- privacy
def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε of (ε, δ)-DP after ``steps`` Poisson-sampled Gaussian steps, by Opacus's RDP accountant.

    0 for no steps; infinite without noise.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if steps < 0 or noise_multiplier < 0:
        raise ValueError("steps and noise_multiplier must be >= 0")
    if steps == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    try:
        from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
        from opacus.accountants.rdp import RDPAccountant
    except ImportError as exc:
        raise ConfigError(
            "the privacy accounting of DP-SGD (noise_multiplier > 0) needs opacus, "
            "which is not installed",
            stage="train",
            found=f"{type(exc).__name__}: {exc}",
            fix="pip install opacus (pip install --no-deps opacus opt_einsum keeps the "
            "installed torch)",
        ) from exc
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=orders)
    eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(eps)


def privacy_spent(config: GradientTrain, n_pixels: int, steps: int) -> tuple[float, float]:
    """(ε, δ) of a run of ``steps`` steps on ``n_pixels`` training pixels; δ defaults to 1/N."""
    delta = config.delta if config.delta is not None else 1.0 / n_pixels
    if config.noise_multiplier == 0:
        return math.inf, delta
    q = sample_rate(config.batch_pixels, n_pixels)
    return epsilon(config.noise_multiplier, q, steps, delta), delta
