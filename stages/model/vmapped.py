"""The ``model`` stage: a single-sample PyTorch model at every pixel, with per-sample gradients.

Each pixel's coefficient vector, reshaped to the model's input shape, is one
sample. The model is written for one sample and batched unchanged with
``torch.func.vmap`` over ``functional_call``; per-sample gradients come from one
backward through per-pixel copies of the parameters (``per_sample.py``), per-sample
Jacobians from ``vmap(jacrev(f))``.
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

This module holds the entry points (``prepare``, ``run_tile``) that
``declare.py`` names; the work is in ``building.py`` (the module and its
weights), ``checks.py`` (the model against the data), ``per_sample.py`` (the
vmapped functions), ``chunk_kernel.py`` (one chunk of pixels), ``compiled.py``
(torch.compile, its checks and its per-process cache) and ``tile_run.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from gridsolve.schemas.artifacts import Tile
from gridsolve.schemas.contracts import MODEL_STATUS_CODES
from gridsolve.schemas.kinds.model import ModelConfig
from gridsolve.schemas.metadata import DesignMeta
from gridsolve.stages.engine.context import StageContext
from gridsolve.stages.engine.store import Artifact, StageOutput
from gridsolve.stages.engine.timing import torch_func_ready
from gridsolve.stages.model.building import (
    _stage,
    apply_weights,
    build_module,
    dim_names,
    input_shape,
    load_weights,
)
from gridsolve.stages.model.checks import (
    _check_input_shape,
    _check_target,
    _one_sample_output,
    batched_probe,
    check_mode,
)
from gridsolve.stages.model.tile_run import (
    _chunk_pixels,
    _pick_kernel,
    _plan_run,
    _run_chunks,
    _run_rows,
    _tile_outputs,
    _tile_result,
)


def prepare(config: ModelConfig, inputs: Mapping[str, Artifact], ctx: StageContext) -> StageOutput:
    """Build the model once, check it against the data, store its parameters and buffers."""
    if config.jacobian:  # jacrev is torch.func's reverse mode; the gradients are not
        torch_func_ready()
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


def run_tile(
    config: ModelConfig,
    inputs: Mapping[str, Artifact],
    prepared: Artifact,
    tile: Tile,
    ctx: StageContext,
) -> StageOutput:
    """Predictions, per-sample gradients (and Jacobians) and the model status of one tile."""
    if config.jacobian:
        torch_func_ready()
    run = _plan_run(config, inputs, prepared, tile, ctx)
    kernel, compile_key = _pick_kernel(run, config, inputs, prepared, ctx.logger)
    chunks = {c: _chunk_pixels(config, run, ctx.memory_budget, compiled=c) for c in (False, True)}
    compiled_ran = False
    if run.rows is not None and kernel is run.eager:
        _run_rows(run, run.rows, chunks[False], ctx.write)
    else:
        compiled_ran = _run_chunks(run, kernel, chunks, compile_key, ctx.logger)
    out, finite_out = _tile_outputs(run)
    px = run.px
    if px.bad_target.any():
        # A non-finite target has no meaningful gradient (it would be NaN or ±inf anyway);
        # predictions and Jacobians do not involve the target and are kept.
        for name, arr in run.flat.items():
            if name.startswith("grad:"):
                arr[..., px.bad_target] = np.nan
    px.status[(px.status == MODEL_STATUS_CODES["ok"]) & ~finite_out] = MODEL_STATUS_CODES[
        "output_not_finite"
    ]
    return _tile_result(px, out, tile, "compiled" if compiled_ran else "eager")
