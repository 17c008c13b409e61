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
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.config import ModelConfig, ModuleModel, MultidimLinearModel
from gridsolve.schemas.contracts import MODEL_STATUS_CODES, MODEL_STATUS_FLAGS, ArraySpec
from gridsolve.schemas.errors import ConfigError, ContractError, InputError
from gridsolve.stages.engine.context import StageContext, chunk_size, resolve_device
from gridsolve.stages.engine.hashing import canonical_json, file_digest, hash_text
from gridsolve.stages.engine.registry import StageDecl, register
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.engine.versions import module_digests
from gridsolve.stages.load.netcdf import read_block
from gridsolve.stages.model.multidim_linear import MultidimLinear

VERSION = "2"


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
def fingerprint(config: ModelConfig, ctx: StageContext) -> dict[str, str]:
    """Digests of the weights file's content and, for a user module, of its package's source.

    The weights by content (a touched or copied file is a hit; the path is not
    in the key). The user's code is the class's module and every module it
    imports, transitively, that is local or of its own package, not only the
    file defining the class.
    """
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
        out["code"] = user_code_digest(cls, config.target)
    return out


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
    stage, name = _stage(config), _model_name(config)
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
    check_mode(module, config)
    # Snapshots taken before any forward, so a forward that mutates state cannot change them.
    params = {k: v.detach().clone() for k, v in module.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in module.named_buffers()}
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


def _per_sample_fns(
    module: nn.Module, config: ModelConfig
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any] | None]:
    """(outputs, gradients, jacobians) functions of (params, buffers, x[, target]), vmapped.

    Only the parameters (and the input) are differentiated; buffers are constants.
    """

    def f(
        params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], x: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = functional_call(module, (params, buffers), (x,))
        return out.reshape(-1)

    if config.objective == "mse":

        def objective(
            params: dict[str, torch.Tensor],
            buffers: dict[str, torch.Tensor],
            x: torch.Tensor,
            t: torch.Tensor,
        ) -> torch.Tensor:
            return ((f(params, buffers, x) - t) ** 2).mean()

        extra: tuple[int | None, ...] = (None, None, 0, 0)
    else:

        def objective(
            params: dict[str, torch.Tensor],
            buffers: dict[str, torch.Tensor],
            x: torch.Tensor,
            t: torch.Tensor,
        ) -> torch.Tensor:
            return f(params, buffers, x).sum()

        extra = (None, None, 0, None)
    argnums: int | tuple[int, ...] = (
        0 if config.wrt == "params" else 2 if config.wrt == "input" else (0, 2)
    )
    outputs = vmap(f, in_dims=(None, None, 0))
    grads = vmap(grad(objective, argnums=argnums), in_dims=extra)
    jac = vmap(jacrev(f, argnums=argnums), in_dims=(None, None, 0)) if config.jacobian else None
    return outputs, grads, jac


def _tensors(
    prepared: Artifact, prefix: str, names: Mapping[str, Any], device: torch.device
) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.array(prepared.array(f"{prefix}:{k}"))).to(device) for k in names
    }


def run_tile(
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Predictions, per-sample gradients (and Jacobians) and the model status of one tile."""
    meta = prepared.meta
    device = resolve_device(config.device)
    dtype = getattr(torch, config.dtype)
    np_dtype = np.dtype(config.dtype)
    module = build_module(config).to(device)
    params = _tensors(prepared, "param", meta["params"], device)
    buffers = _tensors(prepared, "buffer", meta["buffers"], device)
    shape = tuple(meta["input_shape"])
    n_out = int(meta["n_out"])

    coefs = np.asarray(inputs["solve"].array("coefficients"))
    coef = coefs.shape[0]
    X = coefs.reshape(coef, -1).T
    n_px = X.shape[0]
    status = np.full(n_px, MODEL_STATUS_CODES["ok"], np.int8)
    finite_in = np.isfinite(X).all(axis=1)
    status[~finite_in] = MODEL_STATUS_CODES["input_not_finite"]
    ok = np.flatnonzero(finite_in)
    target = None
    bad_target = np.zeros(n_px, bool)
    if config.objective == "mse":
        target = read_block(inputs["load"].meta, "target", tile).reshape(n_out, -1).T
        bad_target = finite_in & ~np.isfinite(target).all(axis=1)
        status[bad_target] = MODEL_STATUS_CODES["target_not_finite"]

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
        put("prediction", f_out(params, buffers, x), sel)
        g = f_grad(params, buffers, x, t)
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
            j = f_jac(params, buffers, x)
            if config.wrt == "params":
                j = (j, None)
            elif config.wrt == "input":
                j = (None, j)
            if j[0] is not None:
                for k, v in j[0].items():
                    put(f"jac:{k}", v, sel)
            if j[1] is not None:
                put("jac:input", j[1], sel)

    if bad_target.any():
        # A non-finite target has no meaningful gradient (it would be NaN or ±inf anyway);
        # predictions and Jacobians do not involve the target and are kept.
        for name, arr in out.items():
            if name.startswith("grad:"):
                arr[..., bad_target] = np.nan
    finite_out = np.ones(n_px, bool)
    for arr in out.values():
        finite_out &= np.isfinite(arr.reshape(-1, n_px)).all(axis=0)
    status[(status == MODEL_STATUS_CODES["ok"]) & ~finite_out] = MODEL_STATUS_CODES[
        "output_not_finite"
    ]

    counts = {
        MODEL_STATUS_FLAGS[int(k)]: int(v)
        for k, v in zip(*np.unique(status, return_counts=True), strict=True)
    }
    ny, nx = tile.shape
    arrays = {k: v.reshape(*v.shape[:-1], ny, nx) for k, v in out.items()}
    arrays["model_status"] = status.reshape(ny, nx)
    return StageOutput(
        arrays=arrays,
        meta={"pixels": len(ok), "skipped": int(n_px - len(ok)), "model_status_counts": counts},
    )


#: Contract of every model tile (gradient and Jacobian variables depend on the model).
TILE_OUTPUTS = {
    "prediction": ArraySpec(("output", "y", "x"), "f"),
    "model_status": ArraySpec(("y", "x"), "i"),
}


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
            outputs=TILE_OUTPUTS,
            summary=_summary,
        )
    )
