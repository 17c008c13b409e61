"""The optimiser step: per-sample gradients, clipped, summed, noised and divided (DP-SGD).

And the checks that a module can be trained so (:func:`check_trainable`), and the
optimiser a config asks for (:func:`make_optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gridsolve.schemas.errors import ConfigError
from gridsolve.schemas.kinds.train import AdamTrain, GradientTrain, SGDTrain

_STABILITY = 1e-6  # Opacus's term in the clipping factor max_norm / (norm + 1e-6)


def _stage(config: GradientTrain) -> str:
    return f"train/{config.impl}"


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
