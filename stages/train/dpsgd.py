"""Numerics of the ``train`` stage: per-sample-clipped minibatch training, optionally DP-SGD.

One pixel is one sample: its coefficients, reshaped to the model's input
shape, are the input, its target values the target, and its loss is the mean
squared error of that one sample. Per-sample gradients come from
``vmap(grad(loss))`` over ``functional_call`` on the unmodified single-sample
module. Each sample's gradient is scaled to an L2 norm (over all parameters
together) of at most ``clip_norm`` with the factor ``min(1, clip/(norm+1e-6))``,
the clipped gradients are summed, Gaussian noise of std
``noise_multiplier·clip_norm`` is added to the sum, and the result is divided
by the batch size; ``torch.optim.SGD``/``Adam`` then steps with that gradient
(exactly as Opacus's DPOptimizer does).

Sampling. Without noise, every epoch shuffles the training pixels and splits
them into consecutive minibatches of ``batch_pixels`` (the last one smaller);
the divisor is the actual batch size. With noise (DP-SGD), each step draws
every pixel independently with probability ``q = batch_pixels/N`` (Poisson
sampling, which the privacy accounting assumes), ``ceil(N/batch_pixels)``
steps per epoch, and the divisor is the expected batch size ``q·N``, never the
drawn one (whose size would otherwise leak through the divisor).

The loss curve. ``train_loss[e]`` and ``val_loss[e]`` have one definition:
the mean over the training (validation) pixels of each pixel's MSE, at the
weights as they are at the end of epoch ``e``, evaluated without clipping and
without noise (a plain vmapped forward pass, in chunks of ``batch_pixels``).
So the last point of the curve is the loss of the last epoch's weights, and
the two curves are comparable. This costs one forward pass over the training
pixels per epoch (no gradients). The best epoch is the one of the lowest
validation loss (the first of equals); with early stopping the weights kept
are that epoch's, otherwise the last epoch's (:attr:`TrainResult.epoch` says
which).

Determinism and resuming. All randomness of epoch ``e`` (1-based) comes from
generators seeded with ``(seed, e)``: the shuffle or the Poisson draws, and
the noise. A :class:`TrainState` taken at the end of any epoch (weights,
optimiser state, history, best weights, patience counter) therefore holds
everything a resumed run needs, and resuming gives byte-identical weights to
an uninterrupted run. Each minibatch's pixels are passed to ``fetch`` sorted
(cheap to read from stored tiles) and processed in one vmapped call; the
validation loss is computed in chunks of ``batch_pixels`` pixels, so results
depend on the config and the data only, never on how ``fetch`` reads them.

Refused modules. BatchNorm in train mode normalises with statistics across
the batch, so a sample's gradient would depend on the other samples (and
per-sample clipping would not bound any one sample's influence): BatchNorm
must be in eval mode (the checkpoint's running statistics). Dropout (and
RReLU) in train mode are refused as well: batched with vmap, each sample's
random mask would depend on the batch composition and size, so results would
not be reproducible from the seed and resuming would not be exact. In eval
mode both are deterministic and allowed.

Privacy. :func:`epsilon` converts (noise multiplier, sample rate, steps, δ)
to ε with Opacus's RDP accountant. The guarantee covers the weights' training
pixels; the validation pixels, which choose the best epoch, are not protected,
and neither is the training loss curve (computed from the training pixels
without noise).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gridsolve.schemas.errors import ConfigError, ContractError, NumericalError
from gridsolve.schemas.kinds.train import AdamTrain, GradientTrain, SGDTrain

#: ``fetch(indices) -> (X (B, *input_shape), Y (B, *output_shape))`` for pixel indices.
Fetch = Callable[[np.ndarray], tuple[Any, Any]]

#: Version of the layout written by :func:`state_to_arrays`.
STATE_FORMAT = 1

# Independent random streams, each seeded with (seed, stream, epoch).
_SPLIT_STREAM = 0
_SAMPLE_STREAM = 1
_NOISE_STREAM = 2

_STABILITY = 1e-6  # Opacus's term in the clipping factor max_norm / (norm + 1e-6)


def _stage(config: GradientTrain) -> str:
    return f"train/{config.impl}"


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


# ---------------------------------------------------------------- checks
def check_trainable(module: nn.Module, stage: str = "train") -> None:
    """ConfigError if a layer would make a sample's gradient depend on the batch or on chance."""
    batch_norm = [
        n or "<root>" for n, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training
    ]
    if batch_norm:
        raise ConfigError(
            "training is refused for a model with BatchNorm in train mode: it normalises with "
            "statistics across the batch, so one pixel's gradient would depend on the other "
            "pixels of the minibatch and clipping would not bound its influence",
            stage=stage,
            found=f"BatchNorm layer(s) in train mode: {', '.join(batch_norm)}",
            fix="set model.mode: eval (BatchNorm then uses the checkpoint's running statistics)",
        )
    random = [
        n or "<root>"
        for n, m in module.named_modules()
        if m.training
        and (
            (isinstance(m, _DropoutNd) and m.p > 0)
            or (isinstance(m, nn.RReLU) and m.lower != m.upper)
        )
    ]
    if random:
        raise ConfigError(
            "training is refused for a model with Dropout/RReLU in train mode: batched over "
            "pixels, each pixel's random mask would depend on the minibatch it falls in, so "
            "training would not be reproducible from the seed",
            stage=stage,
            found=f"random layer(s) in train mode: {', '.join(random)}",
            fix="set model.mode: eval (Dropout is then off, RReLU uses its mean slope)",
        )


# ---------------------------------------------------------------- one step
@dataclass(frozen=True)
class StepStats:
    """Per-sample losses and gradient norms (before clipping) of one step's batch."""

    losses: torch.Tensor
    norms: torch.Tensor


def _per_sample(
    module: nn.Module, buffers: Mapping[str, torch.Tensor]
) -> Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """(params, x (B, …), y (B, …)) → (per-sample gradients by name, per-sample losses)."""

    def loss(params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, (params, dict(buffers)), (x,))
        return ((out - t.reshape(out.shape)) ** 2).mean()

    fn: Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]] = vmap(
        grad_and_value(loss), in_dims=(None, 0, 0)
    )
    return fn


def per_sample_losses(
    module: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Mean squared error of each sample (B,), without gradients."""
    buffers = {k: v.detach() for k, v in module.named_buffers()}

    def loss(x1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, (dict(params), buffers), (x1,))
        return ((out - t.reshape(out.shape)) ** 2).mean()

    with torch.no_grad():
        losses: torch.Tensor = vmap(loss)(x, y)
    return losses


def per_sample_grad_norms(
    module: nn.Module, params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """L2 norm over all parameters of each sample's loss gradient (B,), at ``params``."""
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    grads, _ = _per_sample(module, buffers)(dict(params), x, y)
    return _total_norms(grads)


def _total_norms(grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Each sample's gradient norm over all parameters together (B,): what clipping bounds."""
    n = next(iter(grads.values())).shape[0]
    norms = torch.stack([g.reshape(n, -1).norm(2, dim=-1) for g in grads.values()], dim=1)
    total: torch.Tensor = norms.norm(2, dim=1)
    return total


def dp_step(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    clip_norm: float | None,
    noise_multiplier: float = 0.0,
    divisor: int | None = None,
    generator: torch.Generator | None = None,
) -> StepStats:
    """One optimiser step on a batch with per-sample clipping and optional Gaussian noise.

    ``params`` are the leaf tensors ``optimizer`` updates (in place). Their
    gradient is set to (Σ clipped per-sample gradients + noise) / ``divisor``
    (default: the batch size) and ``optimizer.step()`` is called. An empty
    batch (Poisson sampling) contributes a zero sum. Returns the per-sample
    losses and gradient norms before the step and before clipping.
    """
    if noise_multiplier > 0 and clip_norm is None:
        raise ValueError("noise_multiplier > 0 needs clip_norm")
    n = int(x.shape[0])
    leaves = dict(params)
    if n > 0:
        buffers = {k: v.detach() for k, v in module.named_buffers()}
        detached = {k: v.detach() for k, v in leaves.items()}
        grads, losses = _per_sample(module, buffers)(detached, x, y)
        norms = _total_norms(grads)
        if clip_norm is None:
            summed = {k: g.sum(dim=0) for k, g in grads.items()}
        else:
            factor = (clip_norm / (norms + _STABILITY)).clamp(max=1.0)
            summed = {k: torch.einsum("i,i...", factor, g) for k, g in grads.items()}
    else:
        p0 = next(iter(leaves.values()))
        summed = {k: torch.zeros_like(v) for k, v in leaves.items()}
        losses = torch.zeros(0, dtype=p0.dtype, device=p0.device)
        norms = torch.zeros(0, dtype=p0.dtype, device=p0.device)
    if noise_multiplier > 0:
        assert clip_norm is not None
        std = noise_multiplier * clip_norm
        for k, v in leaves.items():
            summed[k] = summed[k] + torch.normal(
                0.0, std, size=v.shape, generator=generator, dtype=v.dtype, device=v.device
            )
    div = n if divisor is None else divisor
    if div <= 0:
        raise ValueError("an empty batch needs an explicit divisor (the expected batch size)")
    for k, v in leaves.items():
        v.grad = (summed[k] / div).reshape(v.shape)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepStats(losses=losses.detach(), norms=norms.detach())


def make_optimizer(config: GradientTrain, leaves: list[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch optimiser the config names, over ``leaves``."""
    if isinstance(config, SGDTrain):
        return torch.optim.SGD(
            leaves, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if isinstance(config, AdamTrain):
        return torch.optim.Adam(
            leaves,
            lr=config.lr,
            betas=config.betas,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    raise ConfigError(
        f"train impl {config.impl!r} has no optimiser here",
        stage=_stage(config),
        fix="use train impl sgd or adam",
    )


# ---------------------------------------------------------------- state
@dataclass
class TrainState:
    """Everything a run needs to continue after ``epoch`` completed epochs.

    The randomness of every later epoch is derived from ``(seed, epoch)``, so
    no generator state is kept.
    """

    epoch: int
    n_pixels: int
    params: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0
    best_params: dict[str, torch.Tensor] | None = None
    best_loss: float | None = None
    best_epoch: int | None = None
    bad_epochs: int = 0
    stopped: bool = False


@dataclass(frozen=True)
class TrainResult:
    """The weights to keep (best epoch's with early stopping, else the last), their epoch."""

    params: dict[str, torch.Tensor]
    state: TrainState
    #: the epoch at whose end ``params`` were taken (0: no epoch ran)
    epoch: int


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy().copy()


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(a, copy=True))


def state_to_arrays(state: TrainState) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``state`` as numpy arrays and JSON-able metadata; :func:`state_from_arrays` inverts it."""
    arrays = {f"param:{k}": _to_numpy(v) for k, v in state.params.items()}
    if state.best_params is not None:
        arrays.update({f"best:{k}": _to_numpy(v) for k, v in state.best_params.items()})
    opt_state: dict[str, dict[str, Any]] = {}
    for pid, entries in state.optimizer.get("state", {}).items():
        out: dict[str, Any] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                name = f"optim:{pid}:{key}"
                arrays[name] = _to_numpy(value)
                out[key] = {"array": name}
            else:
                out[key] = {"value": value}
        opt_state[str(pid)] = out
    meta = {
        "format": STATE_FORMAT,
        "epoch": state.epoch,
        "n_pixels": state.n_pixels,
        "params": list(state.params),
        "history": copy.deepcopy(state.history),
        "steps": state.steps,
        "has_best": state.best_params is not None,
        "best_loss": state.best_loss,
        "best_epoch": state.best_epoch,
        "bad_epochs": state.bad_epochs,
        "stopped": state.stopped,
        "optimizer": {
            "state": opt_state,
            "param_groups": [_group_to_json(g) for g in state.optimizer.get("param_groups", ())],
        },
    }
    return arrays, meta


def _group_to_json(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items()}


def _group_from_json(group: Mapping[str, Any]) -> dict[str, Any]:
    # JSON turns tuples (Adam's betas) into lists; the optimiser is given tuples.
    return {k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in group.items()}


def state_from_arrays(arrays: Mapping[str, np.ndarray], state: Mapping[str, Any]) -> TrainState:
    """The :class:`TrainState` that :func:`state_to_arrays` wrote (tensors on the CPU).

    ``state`` is the checkpoint's own versioned JSON (``format``), not a kind's metadata.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown train state format {state.get('format')!r}")
    names: list[str] = list(state["params"])
    opt_state: dict[int, dict[str, Any]] = {}
    for pid, entries in state["optimizer"]["state"].items():
        opt_state[int(pid)] = {
            key: _from_numpy(arrays[v["array"]]) if "array" in v else v["value"]
            for key, v in entries.items()
        }
    groups = [_group_from_json(g) for g in state["optimizer"]["param_groups"]]
    return TrainState(
        epoch=int(state["epoch"]),
        n_pixels=int(state["n_pixels"]),
        params={k: _from_numpy(arrays[f"param:{k}"]) for k in names},
        optimizer={"state": opt_state, "param_groups": groups} if groups else {},
        history=copy.deepcopy(list(state["history"])),
        steps=int(state["steps"]),
        best_params=(
            {k: _from_numpy(arrays[f"best:{k}"]) for k in names} if state["has_best"] else None
        ),
        best_loss=None if state["best_loss"] is None else float(state["best_loss"]),
        best_epoch=None if state["best_epoch"] is None else int(state["best_epoch"]),
        bad_epochs=int(state["bad_epochs"]),
        stopped=bool(state["stopped"]),
    )


def _clone(params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in params.items()}


# ---------------------------------------------------------------- training loop
class FiniteFetch:
    """A fetch whose rows are known finite in the model's dtype (checked once, upstream).

    Batches from it skip the per-batch finiteness check; a divergence is still
    caught after every epoch.
    """

    def __init__(self, fetch: Fetch) -> None:
        self._fetch = fetch

    def __call__(self, indices: np.ndarray) -> tuple[Any, Any]:
        """The rows ``indices``."""
        return self._fetch(indices)


def _batch(
    fetch: Fetch,
    idx: np.ndarray,
    like: torch.Tensor,
    input_shape: tuple[int, ...] | None,
    stage: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    xa, ya = fetch(idx)
    x = torch.as_tensor(xa).to(dtype=like.dtype, device=like.device)
    y = torch.as_tensor(ya).to(dtype=like.dtype, device=like.device)
    if input_shape is not None:
        x = x.reshape(len(idx), *input_shape)
    if x.shape[0] != len(idx) or y.shape[0] != len(idx):
        raise ContractError(
            "fetch returned the wrong number of pixels",
            stage=stage,
            expected=f"{len(idx)} pixels (the length of the index array)",
            found=f"inputs {tuple(x.shape)}, targets {tuple(y.shape)}",
        )
    if not isinstance(fetch, FiniteFetch) and not (
        bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())
    ):
        raise ContractError(
            "a training or validation pixel has a non-finite input or target",
            stage=stage,
            fix="pass only pixels with finite coefficients and target values",
        )
    return x, y


def mean_loss(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    fetch: Fetch,
    n_pixels: int,
    chunk_pixels: int,
    *,
    input_shape: tuple[int, ...] | None = None,
    stage: str = "train",
) -> float:
    """Mean over pixels 0..n_pixels-1 of the per-pixel MSE, read in chunks of ``chunk_pixels``."""
    like = next(iter(params.values()))
    total = 0.0
    for start in range(0, n_pixels, chunk_pixels):
        idx = np.arange(start, min(n_pixels, start + chunk_pixels))
        x, y = _batch(fetch, idx, like, input_shape, stage)
        total += float(per_sample_losses(module, params, x, y).double().sum())
    return total / n_pixels


def _fresh_state(params: Mapping[str, torch.Tensor], n_pixels: int) -> TrainState:
    return TrainState(epoch=0, n_pixels=n_pixels, params=_clone(params), optimizer={})


def _check_resumable(
    state: TrainState, params: Mapping[str, torch.Tensor], n_pixels: int, stage: str
) -> None:
    own = {k: tuple(v.shape) for k, v in params.items()}
    saved = {k: tuple(v.shape) for k, v in state.params.items()}
    if state.n_pixels != n_pixels or own != saved:
        raise ContractError(
            "the saved training state does not belong to this model and data",
            stage=stage,
            expected=f"{n_pixels} training pixels, parameters {own}",
            found=f"{state.n_pixels} training pixels, parameters {saved}",
            fix="start training afresh (the state is from another model or pixel selection)",
        )


@dataclass
class _Run:
    """A run in progress: the live weights and optimiser, and what a snapshot of it keeps."""

    epoch: int
    leaves: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    history: list[dict[str, Any]]
    steps: int
    best_params: dict[str, torch.Tensor] | None
    best_loss: float | None
    best_epoch: int | None
    bad_epochs: int
    stopped: bool


@dataclass
class _EpochSums:
    """Sums over one epoch's steps of the per-sample losses and gradient norms, and counts."""

    loss_sum: float = 0.0
    norm_sum: float = 0.0
    clipped: int = 0
    seen: int = 0
    steps: int = 0


def _check_inputs(
    module: nn.Module,
    n_pixels: int,
    validation: tuple[Fetch, int] | None,
    config: GradientTrain,
    stage: str,
) -> None:
    """ContractError/ConfigError if there is nothing to train on or the config cannot apply."""
    if n_pixels < 1:
        raise ContractError(
            "there are no training pixels",
            stage=stage,
            fix="check train.usable_status and the validation_fraction, or the data",
        )
    check_trainable(module, stage)
    n_val = 0 if validation is None else validation[1]
    if config.early_stopping is not None and n_val < 1:
        raise ContractError(
            "early_stopping needs validation pixels, and there are none",
            stage=stage,
            fix="raise train.validation_fraction, or set train.early_stopping: null",
        )


def _start_run(
    params: Mapping[str, torch.Tensor],
    n_pixels: int,
    config: GradientTrain,
    state: TrainState | None,
    stage: str,
) -> _Run:
    """The run continuing ``state`` (or a fresh one), its weights on the device of ``params``."""
    if state is None:
        state = _fresh_state(params, n_pixels)
    else:
        _check_resumable(state, params, n_pixels, stage)
    device = next(iter(params.values())).device
    leaves = {k: v.detach().clone().to(device) for k, v in state.params.items()}
    optimizer = make_optimizer(config, list(leaves.values()))
    if state.optimizer:
        optimizer.load_state_dict(copy.deepcopy(state.optimizer))
    return _Run(
        epoch=state.epoch,
        leaves=leaves,
        optimizer=optimizer,
        history=copy.deepcopy(state.history),
        steps=state.steps,
        best_params=None if state.best_params is None else _clone(state.best_params),
        best_loss=state.best_loss,
        best_epoch=state.best_epoch,
        bad_epochs=state.bad_epochs,
        stopped=state.stopped,
    )


def _snapshot(run: _Run, n_pixels: int) -> TrainState:
    """A copy of ``run`` as a :class:`TrainState`, unaffected by later steps."""
    return TrainState(
        epoch=run.epoch,
        n_pixels=n_pixels,
        params=_clone(run.leaves),
        optimizer=copy.deepcopy(run.optimizer.state_dict()),
        history=copy.deepcopy(run.history),
        steps=run.steps,
        best_params=None if run.best_params is None else _clone(run.best_params),
        best_loss=run.best_loss,
        best_epoch=run.best_epoch,
        bad_epochs=run.bad_epochs,
        stopped=run.stopped,
    )


def _train_epoch(
    module: nn.Module,
    run: _Run,
    fetch: Fetch,
    n_pixels: int,
    config: GradientTrain,
    input_shape: tuple[int, ...] | None,
    stage: str,
) -> _EpochSums:
    """Takes every step of epoch ``run.epoch``, adds them to ``run.steps``, returns its sums."""
    poisson = config.noise_multiplier > 0
    divisor = expected_batch(config.batch_pixels, n_pixels) if poisson else None
    like = next(iter(run.leaves.values()))
    gen = _noise_generator(config.seed, run.epoch, like.device) if poisson else None
    sums = _EpochSums()
    for idx in epoch_batches(n_pixels, config.batch_pixels, poisson, config.seed, run.epoch):
        if len(idx):
            x, y = _batch(fetch, idx, like, input_shape, stage)
        else:
            x = y = torch.zeros(0, dtype=like.dtype, device=like.device)
        stats = dp_step(
            module,
            run.leaves,
            run.optimizer,
            x,
            y,
            clip_norm=config.clip_norm,
            noise_multiplier=config.noise_multiplier,
            divisor=divisor,
            generator=gen,
        )
        sums.loss_sum += float(stats.losses.double().sum())
        sums.norm_sum += float(stats.norms.double().sum())
        if config.clip_norm is not None:
            sums.clipped += int((stats.norms > config.clip_norm).sum())
        sums.seen += len(idx)
        sums.steps += 1
    run.steps += sums.steps
    return sums


def _subset_loss(
    module: nn.Module,
    leaves: Mapping[str, torch.Tensor],
    pixels: tuple[Fetch, int] | None,
    config: GradientTrain,
    input_shape: tuple[int, ...] | None,
    stage: str,
) -> float | None:
    """Mean loss of the pixels of ``(fetch, n)`` at ``leaves``; None without pixels."""
    if pixels is None or pixels[1] < 1:
        return None
    return mean_loss(
        module,
        leaves,
        pixels[0],
        pixels[1],
        config.batch_pixels,
        input_shape=input_shape,
        stage=stage,
    )


def _record_epoch(
    run: _Run, sums: _EpochSums, train_loss: float | None, val_loss: float | None, stage: str
) -> None:
    """Appends epoch ``run.epoch`` to the history; NumericalError if training diverged."""
    seen = sums.seen
    finite = all(
        v is None or math.isfinite(v) for v in (sums.loss_sum, train_loss, val_loss)
    ) and all(bool(torch.isfinite(v).all()) for v in run.leaves.values())
    if not finite:
        raise NumericalError(
            f"training diverged in epoch {run.epoch}: the loss or the weights are not finite",
            stage=stage,
            found=f"train loss {train_loss}, validation loss {val_loss}",
            fix="lower train.lr, or set train.clip_norm",
        )
    run.history.append(
        {
            "epoch": run.epoch,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "steps": sums.steps,
            "pixels": seen,
            "grad_norm_mean": sums.norm_sum / seen if seen else None,
            "clipped_fraction": sums.clipped / seen if seen else None,
        }
    )


def _track_best(run: _Run, val_loss: float | None, patience: int | None) -> None:
    """Updates the best epoch of ``run``, and with early stopping its weights and patience.

    The best epoch is recorded whenever there is a validation loss; its weights
    are kept only with early stopping, the one case in which they are written.
    """
    if val_loss is None:
        return
    if run.best_loss is None or val_loss < run.best_loss:
        run.best_loss, run.best_epoch, run.bad_epochs = val_loss, run.epoch, 0
        if patience is not None:
            run.best_params = _clone(run.leaves)
    elif patience is not None:
        run.bad_epochs += 1
        run.stopped = run.bad_epochs >= patience


def train(
    module: nn.Module,
    params: Mapping[str, torch.Tensor],
    fetch: Fetch,
    n_pixels: int,
    config: GradientTrain,
    *,
    validation: tuple[Fetch, int] | None = None,
    input_shape: tuple[int, ...] | None = None,
    state: TrainState | None = None,
    until_epoch: int | None = None,
    on_epoch: Callable[[TrainState], None] | None = None,
) -> TrainResult:
    """Train ``params`` of the single-sample ``module`` on pixels 0..n_pixels-1.

    ``fetch(indices)`` returns the inputs and targets of those training
    pixels; ``validation = (fetch, n)`` gives the held-out pixels. After every
    epoch the mean loss of the training and of the validation pixels at that
    epoch's final weights is recorded (see the module's docstring); the
    validation loss picks the best epoch and drives early stopping. With
    ``state`` the run continues from that state's epoch; ``until_epoch`` stops
    after that epoch (default: ``config.epochs``); ``on_epoch`` receives a
    snapshot of the state after every epoch. The module itself is not
    modified; its buffers are used as constants.
    """
    stage = _stage(config)
    _check_inputs(module, n_pixels, validation, config, stage)
    run = _start_run(params, n_pixels, config, state, stage)
    last = config.epochs if until_epoch is None else min(until_epoch, config.epochs)
    while not run.stopped and run.epoch < last:
        run.epoch += 1
        sums = _train_epoch(module, run, fetch, n_pixels, config, input_shape, stage)
        at = run.leaves
        train_loss = _subset_loss(module, at, (fetch, n_pixels), config, input_shape, stage)
        val_loss = _subset_loss(module, at, validation, config, input_shape, stage)
        _record_epoch(run, sums, train_loss, val_loss, stage)
        _track_best(run, val_loss, config.early_stopping)
        if on_epoch is not None:
            on_epoch(_snapshot(run, n_pixels))
    final = _snapshot(run, n_pixels)
    if final.best_params is not None:
        assert final.best_epoch is not None
        return TrainResult(params=_clone(final.best_params), state=final, epoch=final.best_epoch)
    return TrainResult(params=_clone(final.params), state=final, epoch=final.epoch)


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
