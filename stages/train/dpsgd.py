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

This module runs the epochs (:func:`train`); the pixel split, the sampling and the
privacy accounting are in ``sampling.py``, the clipped (noised) optimiser step in
``clipped_step.py``, the resumable state and its arrays in ``train_state.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from gridsolve.schemas.errors import ContractError, NumericalError
from gridsolve.schemas.kinds.train import GradientTrain
from gridsolve.stages.train.clipped_step import (
    _stage,
    check_trainable,
    dp_step,
    make_optimizer,
    per_sample_losses,
)
from gridsolve.stages.train.sampling import _noise_generator, epoch_batches, expected_batch
from gridsolve.stages.train.train_state import TrainResult, TrainState, _clone

#: ``fetch(indices) -> (X (B, *input_shape), Y (B, *output_shape))`` for pixel indices.
Fetch = Callable[[np.ndarray], tuple[Any, Any]]


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
