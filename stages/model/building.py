"""Building the model stage's module: the class a config names, seeded construction, weights.

Weights come from a safetensors file or a state dict loaded with
``torch.load(weights_only=True)``; arbitrary pickles are refused.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from gridsolve.schemas.errors import ConfigError, ContractError, InputError
from gridsolve.schemas.kinds.model import ModelConfig, ModuleModel, MultidimLinearModel
from gridsolve.stages.engine.paths import import_named
from gridsolve.stages.model.multidim_linear import MultidimLinear


def _stage(config: ModelConfig) -> str:
    return f"model/{config.impl}"


def _model_name(config: ModelConfig) -> str:
    if isinstance(config, ModuleModel):
        return config.target
    return f"the built-in {config.impl} model"


# ---------------------------------------------------------------- building
def import_target(target: str, stage: str) -> type[nn.Module]:
    """The nn.Module class at ``package.module:Class``."""
    cls = import_named(target, stage, "model.target")
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
    """The model with its seeded initial weights, in the configured dtype and mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        module = _construct(config)
    # .to(dtype) casts floating parameters and buffers only; integer buffers keep their dtype.
    return module.to(getattr(torch, config.dtype)).train(config.mode == "train")


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


def apply_weights(
    module: nn.Module, state: Mapping[str, torch.Tensor], path: str, stage: str
) -> None:
    """Load ``state`` into ``module``; ContractError listing every tensor that does not fit."""
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
    # Each tensor to its own target's dtype: an integer buffer must not set the others' dtype.
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()})


def dim_names(module: nn.Module, name: str, ndim: int) -> tuple[str, ...]:
    """Dim names of a parameter, ``input`` or ``output`` in the output file."""
    declared = getattr(module, "gridsolve_dims", {}).get(name)
    if declared is not None and len(declared) == ndim:
        return tuple(declared)
    safe = name.replace(".", "_")
    return tuple(f"{safe}_d{i}" for i in range(ndim))
