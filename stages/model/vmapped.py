"""The ``model`` stage: a single-sample PyTorch model at every pixel, with per-sample gradients.

Each pixel's coefficient vector, reshaped to the model's input shape, is one
sample. The model is written for one sample and batched unchanged with
``torch.func.vmap`` over ``functional_call``; per-sample gradients come from
``vmap(grad(objective))``, per-sample Jacobians from ``vmap(jacrev(f))``.
(A batched forward and ``.backward()`` would give only the sum of the
per-sample gradients.) The per-sample objective is the sum of the outputs, or
the mean squared error against ``load.target`` with ``objective: mse``.

Weights come from a safetensors file or a state dict loaded with
``torch.load(weights_only=True)``; arbitrary pickles are refused. The whole
checkpoint is honoured: parameters (differentiated) and buffers (constants,
e.g. BatchNorm running statistics) are both passed to ``functional_call``.

``prepare`` runs the model once on one sample and then, batched, exactly the
vmapped functions the tiles will run, so a ``forward`` that vmap cannot batch
is reported there as the model's problem, with the fix. Every pixel gets a
``model_status`` (see :data:`schemas.contracts.MODEL_STATUS_FLAGS`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import pickle
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import MODEL_STATUS_CODES, MODEL_STATUS_FLAGS, flag_counts
from gridsolve.schemas.errors import ConfigError, ContractError, InputError
from gridsolve.schemas.kinds.model import ModelConfig, ModuleModel, MultidimLinearModel
from gridsolve.schemas.metadata import DesignMeta, LoadMeta, ModelPrepared
from gridsolve.stages.engine.agreement import disagreements
from gridsolve.stages.engine.blocks import read_block
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device, work_share
from gridsolve.stages.engine.hashing import canonical_json, hash_text
from gridsolve.stages.engine.paths import ensure_module_allowed
from gridsolve.stages.engine.pyparse import PARSE_LOCK
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.engine.versions import module_digests
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
    mod_name, _, cls_name = target.partition(":")
    ensure_module_allowed(mod_name, stage)
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


# ---------------------------------------------------------------- checks
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:300]}"


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
                found=_first_line(exc),
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


# ---------------------------------------------------------------- stage
def user_code_digest(cls: type, target: str) -> str:
    """Digest of the source a user's model runs: its module and the local modules it imports."""
    module = cls.__module__
    digests = module_digests([module])
    if digests.get(module, "no source") == "no source":
        # Defined where there is no source file (an interactive session).
        try:
            digests[module] = hash_text(inspect.getsource(cls))
        except (OSError, TypeError):
            digests[module] = hash_text(target)
    return hash_text(canonical_json(digests))


def prepare(config: ModelConfig, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """Build the model once, check it against the data, store its parameters and buffers."""
    stage = _stage(config)
    shape = input_shape(config)
    _check_input_shape(shape, DesignMeta.of(inputs["design"]).coef, stage)
    module = build_module(config)
    if config.weights is not None:
        apply_weights(module, load_weights(config.weights, stage), config.weights, stage)
    if "train" in inputs:
        apply_weights(module, _trained_state(module, inputs["train"]), "the train stage", stage)
    check_mode(module, config)
    # Snapshots taken before any forward, so a forward that mutates state cannot change them.
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in module.named_buffers()}
    out = _one_sample_output(module, config, params, buffers, shape)
    n_out = int(out.numel())
    _check_target(config, inputs, n_out)
    batched_probe(module, config, params, buffers, shape, n_out)
    meta = {
        "input_shape": list(shape),
        "input_dims": list(dim_names(module, "input", len(shape))),
        "output_shape": list(out.shape),
        "n_out": n_out,
        "output_dims": ["output"],
        "params": {k: list(v.shape) for k, v in params.items()},
        "param_dims": {k: list(dim_names(module, k, v.ndim)) for k, v in params.items()},
        "buffers": {k: list(v.shape) for k, v in buffers.items()},
        "objective": config.objective,
        "wrt": config.wrt,
        "jacobian": config.jacobian,
        "dtype": config.dtype,
        "mode": config.mode,
    }
    arrays = {f"param:{k}": v.cpu().numpy() for k, v in params.items()}
    arrays.update({f"buffer:{k}": v.cpu().numpy() for k, v in buffers.items()})
    return StageOutput(arrays=arrays, meta=meta)


def _trained_state(module: nn.Module, train: Artifact) -> dict[str, torch.Tensor]:
    """The module's state with the parameters the train stage fitted (buffers unchanged)."""
    state = dict(module.state_dict())
    for name, arr in train.arrays().items():
        if name.startswith("param:"):
            state[name.removeprefix("param:")] = torch.from_numpy(np.array(arr))
    return state


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


def _per_sample_fns(
    module: nn.Module, config: ModelConfig
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]:
    """(outputs, gradients, jacobians) functions of (params, buffers, x[, target]), vmapped.

    The gradients function returns ``(gradients, outputs)``: the outputs come
    from the same forward pass. Only the parameters (and the input) are
    differentiated; buffers are constants.
    """

    def f(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, (params, buffers), (x,))
        return out.reshape(-1)

    def loss(y: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
        if config.objective == "mse":
            assert t is not None
            return ((y - t) ** 2).mean()
        return y.sum()

    def gradients(
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        t: torch.Tensor | None,
    ) -> tuple[Any, torch.Tensor]:
        # The chain rule as autograd applies it to loss(f(x)): d loss/d y first, then
        # f's vector-Jacobian product. The gradient of a sum is an expanded (stride 0)
        # tensor; materialised (clone), vmap batches f's backward as whole-chunk products
        # instead of a loop over the pixels (3-4× faster, same values).
        if config.wrt == "params":
            res = vjp(lambda p: f(p, buffers, x), params)
        elif config.wrt == "input":
            res = vjp(lambda x_: f(params, buffers, x_), x)
        else:
            res = vjp(lambda p, x_: f(p, buffers, x_), params, x)
        y, pull = res[0], res[1]
        g = pull(grad(loss)(y, t).clone())
        return (g[0] if len(g) == 1 else g), y

    argnums: int | tuple[int, ...] = (
        0 if config.wrt == "params" else 2 if config.wrt == "input" else (0, 2)
    )
    t_dim = 0 if config.objective == "mse" else None
    outputs = vmap(f, in_dims=(None, None, 0))
    grads = vmap(gradients, in_dims=(None, None, 0, t_dim))
    jac = vmap(jacrev(f, argnums=argnums), in_dims=(None, None, 0)) if config.jacobian else None
    return outputs, grads, jac


#: A chunk kernel: (params, buffers, x (coef, m), target (n_out, m) | None, outputs) → finite (m,)
#: or None (not computed: the caller checks the outputs).
Kernel = Callable[
    [
        dict[str, torch.Tensor],
        dict[str, torch.Tensor],
        torch.Tensor,
        torch.Tensor | None,
        dict[str, torch.Tensor],
    ],
    torch.Tensor | None,
]


def _named(value: Any, wrt: str, kind: str) -> dict[str, torch.Tensor]:
    """``grad:``/``jac:`` arrays by name from what grad/jacrev returned for ``wrt``."""
    by_param, by_input = (value, None) if wrt == "params" else (None, value)
    if wrt == "both":
        by_param, by_input = value
    out = {f"{kind}:{k}": v for k, v in (by_param or {}).items()}
    if by_input is not None:
        out[f"{kind}:input"] = by_input
    return out


def make_kernel(module: nn.Module, config: ModelConfig, shape: tuple[int, ...]) -> Kernel:
    """The per-chunk function: every output of a chunk of pixels, written in the stored layout.

    It takes the pixels pixel-last, as the coefficients are stored
    (``x (coef, m)``, ``target (n_out, m)``), writes each output into
    ``outputs[name]`` (shape ``(*dims, m)``, pixel-last, as the tiles store
    them) and, compiled, returns whether each pixel's outputs are all finite
    (None in eager mode). One forward pass gives the outputs and the gradients.
    """
    fns = _per_sample_fns(module, config)
    grads, jac = fns[1], fns[2]

    def kernel(
        params: dict[str, torch.Tensor],
        buffers: dict[str, torch.Tensor],
        x: torch.Tensor,
        t: torch.Tensor | None,
        outputs: dict[str, torch.Tensor],
    ) -> torch.Tensor | None:
        m = x.shape[-1]
        # Pixel-first: eager, contiguous, each sample's values adjacent, as the model's ops
        # expect. Compiled, a transposed view: inductor then reads the stored layout directly
        # instead of copying it and transposing it back for gradients that are (functions of)
        # the input (10×10×4 model, 250,000 pixels: 0.100 s against 0.143 s).
        xt = x.t()
        xs = (xt if torch.compiler.is_compiling() else xt.contiguous()).reshape(m, *shape)
        g, y = grads(params, buffers, xs, None if t is None else t.t())
        values = {"prediction": y, **_named(g, config.wrt, "grad")}
        if jac is not None:
            values.update(_named(jac(params, buffers, xs), config.wrt, "jac"))
        for name, v in values.items():
            outputs[name].copy_(v.movedim(0, -1))
        if not torch.compiler.is_compiling():
            # Eager isfinite is three passes with temporaries; numpy's is one (the caller).
            return None
        # Compiled, this fuses into the kernels that write the outputs. o - o is 0 for a finite
        # o and NaN for ±inf or NaN, so a pixel's sum of them is 0 exactly when all its outputs
        # are finite: the flags of isfinite().all(), as a float sum that inductor vectorises
        # across pixels; it ran isfinite().all() one element at a time (121 vs 91 ms for
        # 250,000 pixels of the 10×10×4 model). compiled_kernel checks these flags against
        # numpy's on a pixel with NaN input before the kernel is used.
        finite = torch.ones(m, dtype=torch.bool, device=x.device)
        for name in values:
            o = outputs[name].reshape(-1, m)
            finite &= (o - o).sum(dim=0) == 0
        return finite

    return kernel


# ---------------------------------------------------------------- compiled kernels
#: ``compile: auto`` compiles for grids of at least this many pixels. Measured on the
#: 10×10×4 model (bench_model.py, 2 cores): compiling costs ≈ 5-9 s per process with
#: inductor's disk cache warm (≈ 20 s cold) and saves ≈ 0.6 µs per pixel over eager
#: (0.09 s vs 0.25 s for 250,000 pixels), so it pays there only beyond ≈ 10-30M pixels;
#: models whose eager backward is heavier pay sooner (set ``compile: always``). A pixel
#: count, not a timing, so the choice (and the output's bits) is the same on every run.
COMPILE_MIN_PIXELS = 20_000_000

#: Outputs of one chunk, in bytes: small enough that a chunk's pixel-first results are
#: still in cache when they are written pixel-last (measured on the 10×10×4 model, 2 cores:
#: 4,096-pixel chunks 0.67 s, 32,768-pixel chunks 2.3 s for 250,000 pixels, eager).
CHUNK_BYTES = 8 * 2**20

#: The same for a compiled kernel, which writes the stored layout directly (nothing to keep
#: in cache), so larger chunks only save its per-call cost, ≈ 0.2 ms (10×10×4 model, 250,000
#: pixels: 0.100 s with 8 MiB chunks, 0.094 s with 32 MiB).
CHUNK_BYTES_COMPILED = 32 * 2**20

#: Pixels on which a freshly compiled kernel is checked against the eager one.
COMPILE_CHECK_PIXELS = 64


@dataclass
class _Compiled:
    """One process's compiled kernel of one prepared model (None: use eager)."""

    fn: Kernel | None = None
    checked: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


#: Compiled kernels of this process by prepared artifact key and device: tiles reuse them.
_COMPILED: OrderedDict[str, _Compiled] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
_COMPILED_MAX = 4


def _as_tensor(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():
        # Read-only memory maps of the store: the kernels never write to their inputs.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(a)


def _pixels_dynamic(*tensors: torch.Tensor | None) -> None:
    # Only the pixel dim varies between chunks and tiles: the model's own shapes stay
    # static, so the compiler generates kernels for them (all-dynamic shapes ran 4× slower).
    for t in tensors:
        if t is not None:
            torch._dynamo.mark_dynamic(t, t.ndim - 1)


def _host(outputs: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.detach().to("cpu").numpy() for k, v in outputs.items()}


def compiled_kernel(
    key: str,
    eager: Kernel,
    probe: tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None
    ],
    empty: Callable[[int], dict[str, torch.Tensor]],
    logger: logging.Logger,
) -> Kernel | None:
    """``eager`` compiled with torch.compile, once per process and ``key``; None when it cannot be.

    The first time, the compiled kernel is run on ``probe`` (params, buffers,
    x, target) and compared with ``eager`` under the agreement bound
    (``stages/engine/agreement.py``), and its finite flags, on the probe and
    on the probe with one pixel's input NaN, with numpy's ``isfinite`` of its
    outputs; a compile error or any disagreement is logged and the stage runs
    eager: the compiled path never changes results beyond what the bound
    allows, so it is not part of the cache key.
    """
    with _COMPILED_LOCK:
        entry = _COMPILED.get(key)
        if entry is None:
            entry = _COMPILED[key] = _Compiled()
            while len(_COMPILED) > _COMPILED_MAX:
                _COMPILED.popitem(last=False)
        _COMPILED.move_to_end(key)
    # Dynamo parses source with ast while it compiles: under the parse lock, or a tile
    # thread reading an array header meets CPython 3.11's unsafe ast constructor
    # (stages/engine/pyparse.py). A recompile later (a guard that fails) would parse
    # outside it; the pixel dimension is marked dynamic so that tile sizes do not.
    with entry.lock, PARSE_LOCK:
        if not entry.checked:
            entry.checked = True
            try:
                fn = torch.compile(eager)
                params, buffers, x, t = probe
                got, want = empty(int(x.shape[-1])), empty(int(x.shape[-1]))
                _pixels_dynamic(x, t, *got.values())
                flags = fn(params, buffers, x, t, got)
                eager(params, buffers, x, t, want)
                problems = disagreements(_host(got), _host(want))
                problems += _flag_problems(flags, got)
                fn = _nan_checked(fn, (params, buffers, x, t), got, problems, logger)
            except Exception as exc:
                logger.warning("model: torch.compile failed, running eager: %s", _first_line(exc))
            else:
                if problems:
                    logger.warning(
                        "model: the compiled kernel disagrees with eager beyond the agreement "
                        "bound, running eager: %s",
                        "; ".join(problems),
                    )
                else:
                    entry.fn = fn
    return entry.fn


def _nan_checked(
    fn: Kernel,
    probe: tuple[
        dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor, torch.Tensor | None
    ],
    outputs: dict[str, torch.Tensor],
    problems: list[str],
    logger: logging.Logger,
) -> Kernel:
    """``fn``, its finite flags checked on a probe pixel with NaN input (into ``problems``).

    A NaN input makes most models' outputs not finite, and the flags must say
    so. Chunks come as views of the stored tile or as contiguous copies, which
    the compiler serves with a graph each: both are checked. A model that
    refuses NaN input leaves the flags unchecked: then ``fn``'s flags are
    dropped and the caller checks the outputs itself (slower, never wrong).
    """
    params, buffers, x, t = probe
    m = int(x.shape[-1])
    wide = torch.empty((*x.shape[:-1], 2 * m), dtype=x.dtype, device=x.device)[..., :m]
    try:
        for x_nan in (wide.copy_(x), x.clone(memory_format=torch.contiguous_format)):
            x_nan[..., 0] = float("nan")
            _pixels_dynamic(x_nan)
            problems += _flag_problems(fn(params, buffers, x_nan, t, outputs), outputs)
    except Exception as exc:
        logger.info(
            "model: the model refuses a NaN input (%s): the compiled kernel's outputs are "
            "checked for finite values separately",
            _first_line(exc),
        )

        def without_flags(*args: Any) -> None:
            fn(*args)

        return without_flags
    return fn


def _flag_problems(flags: torch.Tensor | None, outputs: Mapping[str, torch.Tensor]) -> list[str]:
    """Where a compiled kernel's finite flags differ from numpy's isfinite on its outputs."""
    if flags is None:
        return []
    want = _finite_pixels(_host(outputs).values())
    wrong = int((flags.cpu().numpy() != want).sum())
    return [f"finite flags wrong at {wrong} of {want.size} pixels"] if wrong else []


def _finite_pixels(arrays: Iterable[np.ndarray]) -> np.ndarray:
    """Whether each pixel (the last axis) has only finite values in all ``arrays``."""
    finite: np.ndarray | None = None
    for arr in arrays:
        ok = np.isfinite(arr.reshape(-1, arr.shape[-1])).all(axis=0)
        finite = ok if finite is None else finite & ok
    assert finite is not None, "a model has at least one output"
    return finite


def _forget_compiled(key: str | None = None) -> None:
    """Forget this process's compiled kernel of ``key`` (all of them with None)."""
    with _COMPILED_LOCK:
        if key is None:
            _COMPILED.clear()
        else:
            _COMPILED.pop(key, None)


def _tensors(
    prepared: Artifact, prefix: str, names: Mapping[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.array(prepared.array(f"{prefix}:{k}"))).to(device) for k in names
    }


def _output_shapes(meta: ModelPrepared, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Per-pixel shape of every output array, in the order they are stored."""
    n_out, shape = meta.n_out, tuple(meta.input_shape)
    want_params = config.wrt in ("params", "both")
    want_input = config.wrt in ("input", "both")
    out: dict[str, tuple[int, ...]] = {"prediction": (n_out,)}
    for kind, lead in (("grad", ()), ("jac", (n_out,))):
        if kind == "jac" and not config.jacobian:
            continue
        if want_params:
            for k, s in meta.params.items():
                out[f"{kind}:{k}"] = (*lead, *s)
        if want_input:
            out[f"{kind}:input"] = (*lead, *shape)
    return out


@dataclass
class _Pixels:
    """One tile's pixels as the model takes them, and their model status so far."""

    X: np.ndarray  # (coef, n_px) pixel-last, as stored: a view, never transposed
    target: np.ndarray | None  # (n_out, n_px); None unless objective mse
    status: np.ndarray  # (n_px,) int8 model status
    finite_in: np.ndarray  # (n_px,) the pixel's coefficients are all finite
    ok: np.ndarray  # indices of the pixels with finite coefficients
    bad_target: np.ndarray  # (n_px,) finite coefficients but a non-finite target


@dataclass
class _TileRun:
    """One tile's pixels as they are run, chunk by chunk, and the arrays their outputs go to."""

    px: _Pixels
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    eager: Kernel
    shapes: dict[str, tuple[int, ...]]  # per-pixel shape of each output
    dtype: torch.dtype
    np_dtype: np.dtype
    device: torch.device
    dense: bool  # every pixel is run (else only those with finite coefficients)
    src: np.ndarray  # (coef, n_run) the coefficients run
    src_t: np.ndarray | None  # (n_out, n_run) their target
    dest: dict[str, np.ndarray]  # (*shape, n_run) the outputs of the pixels run
    finite_run: np.ndarray  # (n_run,) the pixel's outputs are all finite

    @property
    def n_run(self) -> int:
        """How many pixels are run."""
        return int(self.src.shape[1])

    def inputs(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Coefficients and target of the pixels ``s:e`` run, on the device in the model dtype."""
        px = self.px
        x = self.src[:, s:e]
        if self.dense and not px.finite_in[s:e].all():
            x = x.copy()
            x[:, ~px.finite_in[s:e]] = px.X[:, px.ok[0], None]
        xt = _as_tensor(x).to(device=self.device, dtype=self.dtype)
        tt = (
            None
            if self.src_t is None
            else _as_tensor(self.src_t[:, s:e]).to(device=self.device, dtype=self.dtype)
        )
        return xt, tt

    def empty(self, m: int) -> dict[str, torch.Tensor]:
        """Uninitialised outputs of ``m`` pixels on the device."""
        return {
            k: torch.empty((*s, m), dtype=self.dtype, device=self.device)
            for k, s in self.shapes.items()
        }


def run_tile(
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Predictions, per-sample gradients (and Jacobians) and the model status of one tile."""
    run = _plan_run(config, inputs, prepared, tile)
    kernel, compile_key = _pick_kernel(run, config, inputs, prepared, ctx.logger)
    chunks = {c: _chunk_pixels(config, run, ctx.memory_budget, compiled=c) for c in (False, True)}
    compiled_ran = _run_chunks(run, kernel, chunks, compile_key, ctx.logger)
    out, finite_out = _tile_outputs(run)
    px = run.px
    if px.bad_target.any():
        # A non-finite target has no meaningful gradient (it would be NaN or ±inf anyway);
        # predictions and Jacobians do not involve the target and are kept.
        for name, arr in out.items():
            if name.startswith("grad:"):
                arr[..., px.bad_target] = np.nan
    px.status[(px.status == MODEL_STATUS_CODES["ok"]) & ~finite_out] = MODEL_STATUS_CODES[
        "output_not_finite"
    ]
    return _tile_result(px, out, tile, "compiled" if compiled_ran else "eager")


def _tile_pixels(
    config: ModelConfig, inputs: Mapping[str, Artifact], tile: Tile, n_out: int
) -> _Pixels:
    """The tile's coefficients and target, with the status of pixels the model cannot run on."""
    coefs = np.asarray(inputs["solve"].array("coefficients"))
    coef = coefs.shape[0]
    X = coefs.reshape(coef, -1)  # pixel-last, as stored: a view, never transposed
    n_px = X.shape[1]
    status = np.full(n_px, MODEL_STATUS_CODES["ok"], np.int8)
    finite_in = np.isfinite(X).all(axis=0)
    status[~finite_in] = MODEL_STATUS_CODES["input_not_finite"]
    ok = np.flatnonzero(finite_in)
    target = None
    bad_target = np.zeros(n_px, bool)
    if config.objective == "mse":
        target = read_block(inputs["load"], "target", tile).reshape(n_out, -1)
        bad_target = finite_in & ~np.isfinite(target).all(axis=0)
        status[bad_target] = MODEL_STATUS_CODES["target_not_finite"]
    return _Pixels(X, target, status, finite_in, ok, bad_target)


def _plan_run(
    config: ModelConfig, inputs: Mapping[str, Artifact], prepared: Artifact, tile: Tile
) -> _TileRun:
    """The model, the pixels to run and the arrays for their outputs, for one tile."""
    meta = ModelPrepared.of(prepared)
    device = resolve_device(config.device)
    np_dtype = np.dtype(config.dtype)
    module = build_module(config).to(device)
    params = _tensors(prepared, "param", meta.params, device)
    buffers = _tensors(prepared, "buffer", meta.buffers, device)
    shapes = _output_shapes(meta, config)
    px = _tile_pixels(config, inputs, tile, meta.n_out)
    n_px = px.X.shape[1]
    # Dense: every pixel is computed in place in the stored arrays, a pixel without finite
    # coefficients on a copy of a valid pixel's (a real input, so a forward that could fail
    # on NaN never sees one) and set to NaN after. Mostly-missing tiles are computed compacted
    # (only the valid pixels) and scattered.
    dense = 2 * len(px.ok) >= n_px
    n_run = n_px if dense else len(px.ok)
    return _TileRun(
        px=px,
        params=params,
        buffers=buffers,
        eager=make_kernel(module, config, tuple(meta.input_shape)),
        shapes=shapes,
        dtype=getattr(torch, config.dtype),
        np_dtype=np_dtype,
        device=device,
        dense=dense,
        src=px.X if dense else px.X[:, px.ok],
        src_t=px.target if dense or px.target is None else px.target[:, px.ok],
        dest={k: np.empty((*s, n_run), np_dtype) for k, s in shapes.items()},
        finite_run=np.ones(n_run, bool),
    )


def _chunk_pixels(config: ModelConfig, run: _TileRun, memory_budget: int, compiled: bool) -> int:
    """Pixels per chunk."""
    coef = run.px.X.shape[0]
    per_px = run.np_dtype.itemsize * (sum(int(np.prod(s)) for s in run.shapes.values()) + coef)
    target = CHUNK_BYTES_COMPILED if compiled else CHUNK_BYTES
    return config.chunk_pixels or max(
        256, min(chunk_size(target, per_px), chunk_size(work_share(memory_budget), 4 * per_px))
    )


def _pick_kernel(
    run: _TileRun,
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    logger: logging.Logger,
) -> tuple[Kernel, str]:
    """The kernel to start the tile with (compiled when asked for and checked) and its cache key."""
    kernel: Kernel = run.eager
    grid_px = int(np.prod(LoadMeta.of(inputs["load"]).grid_shape()))
    want_compile = config.compile == "always" or (
        config.compile == "auto" and grid_px >= COMPILE_MIN_PIXELS
    )
    compile_key = f"{prepared.key}:{run.device}"
    if want_compile and run.n_run > 1:
        m = min(COMPILE_CHECK_PIXELS, run.n_run)
        compiled = compiled_kernel(
            compile_key,
            run.eager,
            (run.params, run.buffers, *run.inputs(0, m)),
            run.empty,
            logger,
        )
        kernel = compiled or run.eager
    return kernel, compile_key


def _run_chunks(
    run: _TileRun,
    kernel: Kernel,
    chunks: Mapping[bool, int],
    compile_key: str,
    logger: logging.Logger,
) -> bool:
    """Fill ``run.dest`` and ``run.finite_run``; whether the compiled kernel ran to the end.

    True when it computed at least one chunk and never failed (single-pixel
    chunks always run eager). ``chunks``: pixels per chunk for the eager
    (False) and compiled (True) kernel.
    """
    eager, params, buffers = run.eager, run.params, run.buffers
    on_host = run.device.type == "cpu"
    dest_t = {k: torch.from_numpy(v) for k, v in run.dest.items()}
    e = 0
    compiled_chunks = 0
    while e < run.n_run:
        # the eager kernel's chunks again after a compiled one failed
        s, e = e, min(run.n_run, e + chunks[kernel is not eager])
        x, t = run.inputs(s, e)
        views = {k: v[..., s:e] for k, v in dest_t.items()} if on_host else run.empty(e - s)
        # One pixel would make the compiler specialise (recompile) on a size of 1.
        fn = kernel if e - s > 1 else eager
        if fn is not eager:
            _pixels_dynamic(x, t, *views.values())
        try:
            flags = fn(params, buffers, x, t, views)
            compiled_chunks += fn is not eager
        except Exception as exc:
            if fn is eager:
                raise
            logger.warning("model: compiled kernel failed, running eager: %s", _first_line(exc))
            _forget_compiled(compile_key)
            kernel = eager
            flags = eager(params, buffers, x, t, views)
        if not on_host:
            for k, v in views.items():
                dest_t[k][..., s:e].copy_(v)
        if flags is not None:
            run.finite_run[s:e] = flags.cpu().numpy()
        else:
            run.finite_run[s:e] = _finite_pixels(arr[..., s:e] for arr in run.dest.values())
    return kernel is not eager and compiled_chunks > 0


def _tile_outputs(run: _TileRun) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Every output at every pixel of the tile, and whether each pixel's outputs are all finite.

    Pixels without finite coefficients get NaN outputs.
    """
    px = run.px
    n_px = px.X.shape[1]
    if run.dense:
        out = run.dest
        finite_out = run.finite_run
        missing = np.flatnonzero(~px.finite_in)
        if len(missing):
            for arr in out.values():
                arr[..., missing] = np.nan
    else:
        out = {k: np.full((*s, n_px), np.nan, run.np_dtype) for k, s in run.shapes.items()}
        for k, arr in out.items():
            arr[..., px.ok] = run.dest[k]
        finite_out = np.zeros(n_px, bool)
        finite_out[px.ok] = run.finite_run
    return out, finite_out


def _tile_result(px: _Pixels, out: dict[str, np.ndarray], tile: Tile, kernel: str) -> StageOutput:
    """The tile's arrays in (…, y, x) layout, with its pixel and status counts."""
    n_px = px.X.shape[1]
    counts = flag_counts(px.status, MODEL_STATUS_FLAGS)
    ny, nx = tile.shape
    arrays = {k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.items()}
    arrays["model_status"] = px.status.reshape(ny, nx)
    return StageOutput(
        arrays=arrays,
        meta={
            "pixels": len(px.ok),
            "skipped": int(n_px - len(px.ok)),
            "model_status_counts": counts,
            "kernel": kernel,
        },
    )
