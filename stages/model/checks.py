"""Checks of the model against the data, run once in ``prepare``.

The mode (no batch statistics or random layers in train mode), the batched
probe of the vmapped functions the tiles will run, the input shape against the
coefficients, the output of one sample, and the target against the outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gridsolve.schemas.errors import ConfigError, ContractError, first_line
from gridsolve.schemas.kinds.model import ModelConfig
from gridsolve.schemas.metadata import LoadMeta
from gridsolve.stages.engine.store import Artifact
from gridsolve.stages.model.building import (
    _model_name,
    _stage,
)
from gridsolve.stages.model.per_sample import _per_sample_fns

#: How many samples the batched probe in ``prepare`` runs.
PROBE_SAMPLES = 3

_TENSOR_OPS_FIX = (
    "write forward with tensor ops only: no .item(), .tolist(), .numpy(), float(t)/int(t)/"
    "bool(t), and no if/while on tensor values (use torch.where, torch.clamp or masks)"
)


def check_mode(module: nn.Module, config: ModelConfig) -> None:
    """ConfigError if ``mode: train`` would make outputs depend on other pixels or on chance."""
    if config.mode != "train":
        return
    stage, name = _stage(config), _model_name(config)
    batch_norm = [n for n, m in module.named_modules() if isinstance(m, _BatchNorm)]
    if batch_norm:
        raise ConfigError(
            f"mode: train is refused for {name}: it has BatchNorm, which in train mode "
            "normalises with statistics across the batch (here: the pixels of a chunk), "
            "so a pixel's outputs would depend on the other pixels and on the tiling",
            stage=stage,
            found=f"BatchNorm layer(s) {', '.join(n or '<root>' for n in batch_norm)}",
            fix="set model.mode: eval (BatchNorm then uses the running statistics of the "
            "checkpoint)",
        )
    random = [
        n
        for n, m in module.named_modules()
        if (isinstance(m, _DropoutNd) and m.p > 0)
        or (isinstance(m, nn.RReLU) and m.lower != m.upper)
    ]
    if random:
        raise ConfigError(
            f"mode: train is refused for {name}: Dropout/RReLU draw random numbers in train "
            "mode, and batched over pixels each pixel's draw would depend on how the pixels "
            "are chunked and tiled, so results would not be reproducible",
            stage=stage,
            found=f"random layer(s) {', '.join(n or '<root>' for n in random)}",
            fix="set model.mode: eval (Dropout is then off, RReLU uses its mean slope)",
        )


def _vmap_fix(exc: BaseException) -> str:
    """The fix line for an error that vmap, grad or jacrev raised on the user's forward."""
    text = str(exc)
    if "dynamic shape" in text:
        return (
            "keep every shape independent of the values: no boolean-mask indexing "
            "(x[x > 0]) or nonzero(); use torch.where, or multiply by a mask"
        )
    if "random" in text:
        return (
            "remove random operations (torch.rand*, a hand-written dropout) from forward; "
            "with model.mode: eval Dropout layers are off"
        )
    if "in-place" in text or "inplace" in text:
        return (
            "do not modify the input, parameters or buffers in place in forward "
            "(write y = x * 2, not x.mul_(2) or self.buffer += …)"
        )
    if "floating-point" in text:
        return "return floating-point outputs (gradients and Jacobians need them)"
    return _TENSOR_OPS_FIX + " (see https://pytorch.org/docs/stable/func.ux_limitations.html)"


def _describe_output(out: object) -> str:
    if isinstance(out, Mapping):
        return f"a dict with keys {sorted(map(str, out))}"
    if isinstance(out, tuple | list):
        parts = [
            f"Tensor {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            for v in out
        ]
        return f"a {type(out).__name__} of {len(out)} ({', '.join(parts)})"
    return f"a {type(out).__name__}"


def _snapshot(tensors: Mapping[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: v.detach().cpu().contiguous().numpy().tobytes() for k, v in tensors.items()}


def batched_probe(
    module: nn.Module,
    config: ModelConfig,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    shape: tuple[int, ...],
    n_out: int,
) -> None:
    """Run the vmapped forward, gradient and Jacobian the tiles will run on a few samples.

    Raises a ContractError naming the model, the step that failed and the fix
    when vmap cannot batch ``forward``, or when ``forward`` modifies its input
    or the module's buffers in place (state carried from pixel to pixel).
    """
    stage, name = _stage(config), _model_name(config)
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((PROBE_SAMPLES, *shape), generator=gen, dtype=dtype)
    t = torch.zeros((PROBE_SAMPLES, n_out), dtype=dtype)
    p = {k: v.detach().clone() for k, v in params.items()}
    b = {k: v.detach().clone() for k, v in buffers.items()}
    f_out, f_grad, f_jac = _per_sample_fns(module, config)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("forward", lambda: f_out(p, b, x)),
        (
            f"gradient of the {config.objective} objective with respect to {config.wrt}",
            lambda: f_grad(p, b, x, t),
        ),
    ]
    if f_jac is not None:
        steps.append((f"Jacobian with respect to {config.wrt}", lambda: f_jac(p, b, x)))
    before = _snapshot({"input": x, **{f"buffer {k!r}": v for k, v in b.items()}})
    for what, call in steps:
        try:
            call()
        except Exception as exc:
            raise ContractError(
                f"{name} cannot be batched over pixels: its {what}, vmapped over "
                f"{PROBE_SAMPLES} samples, failed",
                stage=stage,
                expected="forward written for ONE sample with tensor operations that "
                "torch.func.vmap batches unchanged",
                found=first_line(exc),
                fix=_vmap_fix(exc),
            ) from exc
        after = _snapshot({"input": x, **{f"buffer {k!r}": v for k, v in b.items()}})
        changed = [k for k in before if after[k] != before[k]]
        if changed:
            raise ContractError(
                f"{name} modifies {', '.join(changed)} in place in its {what}: state would "
                "carry over from one pixel (or chunk) to the next",
                stage=stage,
                fix="compute new tensors instead (y = x * 2, not x.mul_(2); no self.buffer += …)",
            )


def _check_input_shape(shape: tuple[int, ...], coef: int, stage: str) -> None:
    """Raise a ContractError unless one sample of ``shape`` holds exactly ``coef`` numbers."""
    if int(np.prod(shape)) != coef:
        raise ContractError(
            "the model's input shape does not hold the coefficients",
            stage=stage,
            expected=f"input shape multiplying to coef = {coef}",
            found=f"input shape {shape} ({int(np.prod(shape))} numbers)",
            fix="change the model's input dims (e.g. input_dim·hidden_dim = coef) or the design",
        )


def _one_sample_output(
    module: nn.Module,
    config: ModelConfig,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    shape: tuple[int, ...],
) -> torch.Tensor:
    """The model's output for one all-zero sample; a ContractError unless it is one float tensor."""
    stage, name = _stage(config), _model_name(config)
    dtype = getattr(torch, config.dtype)
    try:
        with torch.no_grad():
            one = (
                {k: v.clone() for k, v in params.items()},
                {k: v.clone() for k, v in buffers.items()},
            )
            out = functional_call(module, one, (torch.zeros(shape, dtype=dtype),))
    except Exception as exc:
        raise ContractError(
            f"{name} fails on one sample",
            stage=stage,
            expected=f"forward(x) to accept one sample x of shape {shape}",
            found=f"{type(exc).__name__}: {exc}",
            fix="write the model for ONE sample (no batch dim), or fix model.input_shape",
        ) from exc
    if not isinstance(out, torch.Tensor):
        raise ContractError(
            f"{name} returns {_describe_output(out)}, not one tensor",
            stage=stage,
            expected="forward(x) to return ONE tensor (flattened, it is the output dim)",
            fix="return one tensor, e.g. torch.cat([a.reshape(-1), b.reshape(-1)]) or "
            "torch.stack((a, b)) of the outputs (for a dict: of its values, in a fixed order)",
        )
    if not out.is_floating_point():
        raise ContractError(
            f"{name} returns a {out.dtype} tensor",
            stage=stage,
            expected="floating-point outputs (gradients and Jacobians need them)",
            fix="return floating-point values, e.g. out.to(x.dtype)",
        )
    return out


def _check_target(config: ModelConfig, inputs: Mapping[str, Artifact], n_out: int) -> None:
    """Raise unless objective mse has a target with one value per model output."""
    stage = _stage(config)
    target = LoadMeta.of(inputs["load"]).aux.get("target")
    if config.objective == "mse":
        if target is None:
            raise ConfigError(
                "model objective 'mse' needs a target", stage=stage, fix="set load.target"
            )
        if target.n_out != n_out:
            raise ContractError(
                "the target does not match the model's outputs",
                stage=stage,
                expected=f"{n_out} target value(s) per pixel",
                found=f"{target.n_out} in variable {target.name!r}",
                fix="choose a target variable with one value per model output",
            )
