"""The ``model`` stage: a single-sample PyTorch model at every pixel, with per-sample gradients.

Each pixel's coefficient vector, reshaped to the model's input shape, is one
sample. The model is written for one sample and batched unchanged with
``torch.func.vmap`` over ``functional_call``; per-sample gradients come from
``vmap(grad(objective))``, per-sample Jacobians from ``vmap(jacrev(f))``.
(A batched forward and ``.backward()`` would give only the sum of the
per-sample gradients.) The per-sample objective is the sum of the outputs, or
the mean squared error against ``load.target`` with ``objective: mse``.

Weights come from a safetensors file or a state dict loaded with
``torch.load(weights_only=True)``; arbitrary pickles are refused.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from schemas.artifacts import Tile
from schemas.config import ModelConfig, ModuleModel, MultidimLinearModel
from schemas.errors import ConfigError, ContractError, InputError
from stages.context import StageContext, chunk_size, resolve_device
from stages.hashing import file_digest, hash_text
from stages.load import read_block
from stages.models import MultidimLinear
from stages.registry import StageDecl, register
from stages.store import Artifact, StageOutput

VERSION = "1"


def _stage(config: ModelConfig) -> str:
    return f"model/{config.impl}"


# ---------------------------------------------------------------- building
def import_target(target: str, stage: str) -> type[nn.Module]:
    """The nn.Module class at ``package.module:Class``."""
    mod_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(mod_name)
    except Exception as exc:
        raise ConfigError(
            f"cannot import module {mod_name!r} for model.target",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix="check the spelling, and that the package is installed where the flow runs",
        ) from exc
    cls = getattr(module, cls_name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ConfigError(
            f"model.target {target!r} is not a torch.nn.Module class",
            stage=stage,
            found=repr(cls),
            fix="point model.target at a class that subclasses torch.nn.Module",
        )
    return cls


def _construct(config: ModelConfig) -> nn.Module:
    if isinstance(config, MultidimLinearModel):
        return MultidimLinear(config.input_dim, config.hidden_dim, config.output_dim)
    assert isinstance(config, ModuleModel)
    cls = import_target(config.target, _stage(config))
    try:
        return cls(**config.kwargs)
    except Exception as exc:
        raise ConfigError(
            f"constructing {config.target} with model.kwargs failed",
            stage=_stage(config),
            found=f"{type(exc).__name__}: {exc}",
            fix="give the constructor's keyword arguments in model.kwargs",
        ) from exc


def build_module(config: ModelConfig) -> nn.Module:
    """The model with its seeded initial weights, in the configured dtype, in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        module = _construct(config)
    return module.to(getattr(torch, config.dtype)).eval()


def input_shape(config: ModelConfig) -> tuple[int, ...]:
    """Shape of one sample's input."""
    if isinstance(config, MultidimLinearModel):
        return (config.input_dim, config.hidden_dim)
    assert isinstance(config, ModuleModel)
    return tuple(config.input_shape)


def load_weights(path: str, stage: str) -> dict[str, torch.Tensor]:
    """A state dict from safetensors, or from ``torch.load(weights_only=True)``; never a pickle."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"weights file not found: {p}", stage=stage, fix="check model.weights")
    fix_format = (
        "save the weights with safetensors.torch.save_file(model.state_dict(), "
        "'weights.safetensors'), or torch.save(model.state_dict(), 'weights.pt')"
    )
    if p.suffix.lower() == ".safetensors":
        try:
            return dict(load_file(str(p)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise InputError(
                f"weights file {p} is not a valid safetensors file",
                stage=stage,
                found=str(exc),
                fix=fix_format,
            ) from exc
    try:
        obj = torch.load(p, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise InputError(
            f"refused to load {p}: it is a pickle holding objects other than tensors",
            stage=stage,
            found=first,
            expected="a state dict of tensors (gridsolve never unpickles arbitrary objects)",
            fix=fix_format,
        ) from exc
    except Exception as exc:
        raise InputError(
            f"weights file {p} cannot be read (corrupt, or not a torch/safetensors file)",
            stage=stage,
            found=f"{type(exc).__name__}: {exc}",
            fix=fix_format,
        ) from exc
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not (isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())):
        raise InputError(
            f"weights file {p} does not hold a state dict of tensors",
            stage=stage,
            found=type(obj).__name__,
            fix=fix_format,
        )
    return {str(k): v for k, v in obj.items()}


def _apply_weights(
    module: nn.Module, state: Mapping[str, torch.Tensor], path: str, stage: str
) -> None:
    own = dict(module.state_dict())
    problems = [
        f"missing tensor {k!r} of shape {tuple(v.shape)}" for k, v in own.items() if k not in state
    ]
    problems += [f"unexpected tensor {k!r}" for k in state if k not in own]
    problems += [
        f"{k}: file has shape {tuple(state[k].shape)}, the model needs {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and tuple(state[k].shape) != tuple(v.shape)
    ]
    if problems:
        raise ContractError(
            f"weights in {path} do not fit the model",
            stage=stage,
            violations=problems,
            fix="use the checkpoint saved from this model with these constructor arguments",
        )
    dtype = next(iter(own.values())).dtype if own else torch.float32
    module.load_state_dict({k: v.to(dtype) for k, v in state.items()})


def dim_names(module: nn.Module, name: str, ndim: int) -> tuple[str, ...]:
    """Dim names of a parameter, ``input`` or ``output`` in the output file."""
    declared = getattr(module, "gridsolve_dims", {}).get(name)
    if declared is not None and len(declared) == ndim:
        return tuple(declared)
    safe = name.replace(".", "_")
    return tuple(f"{safe}_d{i}" for i in range(ndim))


# ---------------------------------------------------------------- stage
def fingerprint(config: ModelConfig, ctx: StageContext) -> dict[str, str]:
    """Digests of the weights file and, for a user module, of its source code."""
    out: dict[str, str] = {}
    if config.weights is not None:
        if not Path(config.weights).is_file():
            raise InputError(
                f"weights file not found: {config.weights}",
                stage=_stage(config),
                fix="check model.weights",
            )
        out["weights"] = file_digest(config.weights)
    if isinstance(config, ModuleModel):
        cls = import_target(config.target, _stage(config))
        try:
            source = inspect.getsource(inspect.getmodule(cls) or cls)
        except (OSError, TypeError):
            source = config.target
        out["code"] = hash_text(source)
    return out


def prepare(config: ModelConfig, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """Build the model once, check it against the data, store its parameters."""
    stage = _stage(config)
    coef = int(inputs["design"].meta["coef"])
    shape = input_shape(config)
    if int(np.prod(shape)) != coef:
        raise ContractError(
            "the model's input shape does not hold the coefficients",
            stage=stage,
            expected=f"input shape multiplying to coef = {coef}",
            found=f"input shape {shape} ({int(np.prod(shape))} numbers)",
            fix="change the model's input dims (e.g. input_dim·hidden_dim = coef) or the design",
        )
    module = build_module(config)
    if config.weights is not None:
        _apply_weights(module, load_weights(config.weights, stage), config.weights, stage)
    dtype = getattr(torch, config.dtype)
    try:
        with torch.no_grad():
            out = module(torch.zeros(shape, dtype=dtype))
    except Exception as exc:
        raise ContractError(
            "the model fails on one sample",
            stage=stage,
            expected=f"forward(x) to accept one sample x of shape {shape}",
            found=f"{type(exc).__name__}: {exc}",
            fix="write the model for ONE sample (no batch dim), or fix model.input_shape",
        ) from exc
    if not isinstance(out, torch.Tensor):
        raise ContractError(
            "the model must return one tensor", stage=stage, found=type(out).__name__
        )
    n_out = int(out.numel())
    target = inputs["load"].meta["aux"].get("target")
    if config.objective == "mse":
        if target is None:
            raise ConfigError(
                "model objective 'mse' needs a target", stage=stage, fix="set load.target"
            )
        if int(target["n_out"]) != n_out:
            raise ContractError(
                "the target does not match the model's outputs",
                stage=stage,
                expected=f"{n_out} target value(s) per pixel",
                found=f"{target['n_out']} in variable {target['name']!r}",
                fix="choose a target variable with one value per model output",
            )
    params = {k: v.detach().cpu().numpy() for k, v in module.named_parameters()}
    meta = {
        "input_shape": list(shape),
        "input_dims": list(dim_names(module, "input", len(shape))),
        "output_shape": list(out.shape),
        "n_out": n_out,
        "output_dims": ["output"],
        "params": {k: list(v.shape) for k, v in params.items()},
        "param_dims": {k: list(dim_names(module, k, v.ndim)) for k, v in params.items()},
        "objective": config.objective,
        "wrt": config.wrt,
        "jacobian": config.jacobian,
        "dtype": config.dtype,
    }
    return StageOutput(arrays={f"param:{k}": v for k, v in params.items()}, meta=meta)


def _per_sample_fns(
    module: nn.Module, config: ModelConfig
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]:
    """(outputs, gradients, jacobians) functions, each vmapped over samples."""

    def f(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, params, (x,))
        return out.reshape(-1)

    if config.objective == "mse":

        def objective(
            params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor
        ) -> torch.Tensor:
            return ((f(params, x) - t) ** 2).mean()

        extra: tuple[int | None, ...] = (None, 0, 0)
    else:

        def objective(
            params: dict[str, torch.Tensor], x: torch.Tensor, t: torch.Tensor
        ) -> torch.Tensor:
            return f(params, x).sum()

        extra = (None, 0, None)
    argnums: int | tuple[int, ...] = (
        0 if config.wrt == "params" else 1 if config.wrt == "input" else (0, 1)
    )
    outputs = vmap(f, in_dims=(None, 0))
    grads = vmap(grad(objective, argnums=argnums), in_dims=extra)
    jac = vmap(jacrev(f, argnums=argnums), in_dims=(None, 0)) if config.jacobian else None
    return outputs, grads, jac


def run_tile(
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Predictions and per-sample gradients (and Jacobians) of one tile."""
    meta = prepared.meta
    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype)
    np_dtype = np.dtype(config.dtype)
    module = build_module(config).to(device)
    params = {
        k: torch.from_numpy(np.array(prepared.array(f"param:{k}"))).to(device)
        for k in meta["params"]
    }
    shape = tuple(meta["input_shape"])
    n_out = int(meta["n_out"])

    coefs = np.asarray(inputs["solve"].array("coefficients"))
    coef = coefs.shape[0]
    X = coefs.reshape(coef, -1).T
    n_px = X.shape[0]
    ok = np.flatnonzero(np.isfinite(X).all(axis=1))
    target = None
    if config.objective == "mse":
        target = read_block(inputs["load"].meta, "target", tile).reshape(n_out, -1).T

    want_params = config.wrt in ("params", "both")
    want_input = config.wrt in ("input", "both")
    out: dict[str, np.ndarray] = {"prediction": np.full((n_out, n_px), np.nan, np_dtype)}
    if want_params:
        for k, s in meta["params"].items():
            out[f"grad:{k}"] = np.full((*s, n_px), np.nan, np_dtype)
    if want_input:
        out["grad:input"] = np.full((*shape, n_px), np.nan, np_dtype)
    if config.jacobian:
        if want_params:
            for k, s in meta["params"].items():
                out[f"jac:{k}"] = np.full((n_out, *s, n_px), np.nan, np_dtype)
        if want_input:
            out["jac:input"] = np.full((n_out, *shape, n_px), np.nan, np_dtype)

    per_px = sum(int(np.prod(a.shape[:-1])) for a in out.values()) + coef
    chunk = config.chunk_pixels or min(
        65536, chunk_size(ctx.memory_budget // 4, 4 * np_dtype.itemsize * per_px)
    )
    f_out, f_grad, f_jac = _per_sample_fns(module, config)

    def put(name: str, value: torch.Tensor, sel: np.ndarray) -> None:
        v = value.detach().to("cpu")
        if name.startswith("jac:"):
            v = v.reshape(len(sel), n_out, *v.shape[2:])
        out[name][..., sel] = np.moveaxis(v.numpy(), 0, -1)

    for start in range(0, len(ok), chunk):
        sel = ok[start : start + chunk]
        x = (
            torch.from_numpy(np.ascontiguousarray(X[sel]))
            .to(device=device, dtype=dtype)
            .reshape(-1, *shape)
        )
        t = (
            torch.from_numpy(np.ascontiguousarray(target[sel])).to(device=device, dtype=dtype)
            if target is not None
            else None
        )
        put("prediction", f_out(params, x), sel)
        g = f_grad(params, x, t)
        if config.wrt == "params":
            g = (g, None)
        elif config.wrt == "input":
            g = (None, g)
        if g[0] is not None:
            for k, v in g[0].items():
                put(f"grad:{k}", v, sel)
        if g[1] is not None:
            put("grad:input", g[1], sel)
        if f_jac is not None:
            j = f_jac(params, x)
            if config.wrt == "params":
                j = (j, None)
            elif config.wrt == "input":
                j = (None, j)
            if j[0] is not None:
                for k, v in j[0].items():
                    put(f"jac:{k}", v, sel)
            if j[1] is not None:
                put("jac:input", j[1], sel)

    ny, nx = tile.shape
    return StageOutput(
        arrays={k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.items()},
        meta={"pixels": len(ok), "skipped": int(n_px - len(ok))},
    )


for _impl, _cfg, _summary in (
    ("multidim_linear", MultidimLinearModel, "tensordot(x, weight, 2) + bias, one sample"),
    ("module", ModuleModel, "any single-sample nn.Module by import path"),
):
    register(
        StageDecl(
            kind="model",
            impl=_impl,
            version=VERSION,
            config=_cfg,
            run=run_tile,
            prepare=prepare,
            fingerprint=fingerprint,
            tiled=True,
            inputs=("load", "design", "solve"),
            summary=_summary,
        )
    )
