"""Configs of the built-in ``train`` implementations: fitting the model's weights to the target.

``none`` keeps the model's weights as they are. ``sgd`` and ``adam`` fit them
to ``load.target`` by per-sample-clipped minibatch gradient descent (DP-SGD
when ``noise_multiplier`` > 0), one pixel being one sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, needs_load_field
from gridsolve.schemas.contracts import STATUS_CODES


class TrainConfig(StageConfig):
    """Family of ``train`` implementations."""

    kind: ClassVar[str] = "train"


class NoTrain(TrainConfig):
    """No training: the model runs with its initial or loaded weights."""

    model_config = ConfigDict(title="No training")

    impl: Literal["none"] = "none"

    @property
    def active(self) -> bool:
        """Never: without training the run is the run it was before the kind existed."""
        return False


class GradientTrain(TrainConfig):
    """Fields shared by the gradient-descent trainers (per-sample clipping, optional DP noise)."""

    epochs: int = Field(20, ge=1, description="Passes over the training pixels.")
    batch_pixels: int = Field(
        4096,
        ge=1,
        description="Pixels per optimiser step (with noise_multiplier > 0: the expected "
        "number, each pixel being drawn independently with probability batch_pixels/N).",
    )
    lr: float = Field(0.01, gt=0.0, description="Learning rate.")
    clip_norm: float | None = Field(
        1.0,
        gt=0.0,
        description="Each pixel's gradient is scaled to an L2 norm (over all parameters "
        "together) of at most clip_norm before the gradients are summed; null: no clipping.",
    )
    noise_multiplier: float = Field(
        0.0,
        ge=0.0,
        description="DP-SGD: Gaussian noise of std noise_multiplier·clip_norm is added to the "
        "sum of the clipped gradients at each step, and pixels are Poisson-sampled; 0: no "
        "noise, pixels shuffled each epoch.",
    )
    seed: int = Field(
        0,
        ge=0,
        description="Seed of the shuffling or sampling, the noise and the validation split.",
    )
    validation_fraction: float = Field(
        0.1,
        ge=0.0,
        le=0.5,
        description="Fraction of the pixels held out for the validation loss, chosen as whole "
        "8×8-pixel blocks of a fixed grid (independent of the tiling).",
    )
    early_stopping: int | None = Field(
        None,
        ge=1,
        description="Patience: stop after this many epochs without a lower validation loss "
        "and keep the weights of the best epoch; null: run every epoch, keep the last weights.",
    )
    usable_status: tuple[str, ...] = Field(
        ("ok",),
        min_length=1,
        description="Solve statuses of the pixels used for training and validation.",
    )
    delta: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="δ of the (ε, δ) privacy guarantee reported with noise_multiplier > 0; "
        "default 1/N for N training pixels.",
    )

    @field_validator("usable_status")
    @classmethod
    def _known_status(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [s for s in v if s not in STATUS_CODES]
        if unknown:
            raise ValueError(
                f"unknown solve status {', '.join(map(repr, unknown))} in usable_status; "
                f"known: {', '.join(STATUS_CODES)}"
            )
        if len(set(v)) != len(v):
            raise ValueError("usable_status names a status more than once")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GradientTrain:
        if self.clip_norm is None and self.noise_multiplier > 0:
            raise ValueError(
                "noise_multiplier > 0 needs clip_norm (the noise is scaled to the clipping "
                "bound): set clip_norm (e.g. clip_norm: 1.0), or noise_multiplier: 0"
            )
        if self.early_stopping is not None and self.validation_fraction == 0:
            raise ValueError(
                "early_stopping needs a validation loss: set validation_fraction > 0 "
                "(e.g. 0.1), or early_stopping: null"
            )
        return self

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """Training fits the model to the target variable named in the load section."""
        out = needs_load_field(
            stages, "target", f"train impl {self.impl!r} needs a target: set load.target"
        )
        model = stages.get("model")
        if model is not None and not model.active:
            out.append(
                f"train impl {self.impl!r} fits a model's weights, and the run has none: add a "
                "model section (e.g. model: {impl: multidim_linear, input_dim: 2, hidden_dim: "
                "2, output_dim: 1, objective: mse}), or train: {impl: none}"
            )
        return out


class SGDTrain(GradientTrain):
    """Minibatch SGD (torch.optim.SGD) with per-sample gradient clipping, optionally DP-SGD."""

    model_config = ConfigDict(title="Train with SGD")

    impl: Literal["sgd"] = "sgd"
    momentum: float = Field(0.0, ge=0.0, lt=1.0, description="SGD momentum.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 weight decay (added to the gradient).")


class AdamTrain(GradientTrain):
    """Adam (torch.optim.Adam) with per-sample gradient clipping, optionally DP-Adam."""

    model_config = ConfigDict(title="Train with Adam")

    impl: Literal["adam"] = "adam"
    betas: tuple[float, float] = Field(
        (0.9, 0.999), description="Adam's decay rates of the first and second moments."
    )
    eps: float = Field(1e-8, gt=0.0, description="Adam's term added to the denominator.")
    weight_decay: float = Field(0.0, ge=0.0, description="L2 weight decay (added to the gradient).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError("adam betas must each be in [0, 1), e.g. [0.9, 0.999]")
        return v


for _builtin in (NoTrain, SGDTrain, AdamTrain):
    catalog.add(_builtin)
