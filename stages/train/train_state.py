"""A training run's resumable state (:class:`TrainState`), its result, and their arrays.

:func:`state_to_arrays` and :func:`state_from_arrays` turn a state into named numpy
arrays and JSON and back (the train stage's checkpoints), bit for bit.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

#: Version of the layout written by :func:`state_to_arrays`.
STATE_FORMAT = 1


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
