"""Configs of the built-in ``model`` implementations; the family holds the fields all share.

``none`` runs no model (the default when a config has no ``model`` section):
most per-pixel fits want coefficients, trends and their uncertainty only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from gridsolve.schemas import catalog
from gridsolve.schemas.base import StageConfig, input_file_field, needs_load_field, speed_field


class ModelConfig(StageConfig):
    """Family of ``model`` implementations; the fields here are shared by all."""

    kind: ClassVar[str] = "model"

    weights: str | None = input_file_field(
        None,
        "Weights file: .safetensors, or a state dict saved with torch.save (loaded with "
        "weights_only=True). Omitted: seeded initialisation.",
    )
    seed: int = Field(0, ge=0, description="Seed of the initial weights when no file is given.")
    objective: Literal["sum", "mse"] = Field(
        "sum",
        description="Per-sample objective whose gradient is returned: sum of the outputs, "
        "or mean squared error against load.target.",
    )
    wrt: Literal["params", "input", "both"] = Field(
        "params", description="Gradients with respect to the parameters, the input, or both."
    )
    jacobian: bool = Field(
        False, description="Also write the full per-sample Jacobian of the outputs."
    )
    dtype: Literal["float32", "float64"] = Field("float32", description="Model dtype.")
    mode: Literal["eval", "train"] = Field(
        "eval",
        description="Module mode: eval (default; BatchNorm uses the checkpoint's running "
        "statistics, Dropout is off) or train. train is allowed only where it stays "
        "per-sample and deterministic: a model with BatchNorm (statistics across pixels) "
        "or Dropout/RReLU (random masks that would depend on the tiling) is refused.",
    )
    device: str = speed_field(
        "auto", "auto, cpu, cuda or cuda:N.", pattern=r"^(auto|cpu|cuda(:\d+)?)$"
    )
    chunk_pixels: int | None = speed_field(
        None, "Pixels per vmap chunk; default from the memory budget.", ge=1
    )
    compile: Literal["auto", "always", "never"] = speed_field(
        "auto",
        "torch.compile the per-pixel function: auto (when the grid has at least 20 million "
        "pixels, where compiling pays), always, or never. A compiled function is checked "
        "against the eager one on the first pixels of each process within the agreement "
        "bound, and any compile failure or disagreement falls back to eager.",
    )

    def peer_payload(self) -> dict[str, Any]:
        """The fields that define the module and its initial weights (what training reads).

        What the model stage outputs (objective, wrt, jacobian) and speed-only
        fields are left out, so changing them never retrains.
        """
        outputs_only = {"objective", "wrt", "jacobian"}
        return {k: v for k, v in self.key_payload().items() if k not in outputs_only}

    def cross_stage(self, stages: Mapping[str, StageConfig]) -> list[str]:
        """Objective mse needs the target variable named in the load section."""
        if self.objective != "mse":
            return []
        return needs_load_field(
            stages, "target", "model objective 'mse' needs a target: set load.target"
        )


class NoModel(StageConfig):
    """No model: the run stops at the coefficients (and their uncertainty) and writes them."""

    model_config = ConfigDict(title="No model")

    kind: ClassVar[str] = "model"
    impl: Literal["none"] = "none"

    @property
    def active(self) -> bool:
        """Never: a ``none`` model is left out of the plan, and nothing of a model is written."""
        return False


class MultidimLinearModel(ModelConfig):
    """The multidim linear model: tensordot(x, weight, 2) + bias, x of (input_dim, hidden_dim)."""

    model_config = ConfigDict(title="Multidim linear model")

    impl: Literal["multidim_linear"] = "multidim_linear"
    input_dim: int = Field(10, ge=1, description="First input dim (coef = input_dim·hidden_dim).")
    hidden_dim: int = Field(10, ge=1, description="Second input dim.")
    output_dim: int = Field(4, ge=1, description="Number of outputs.")


class ModuleModel(ModelConfig):
    """Any single-sample torch.nn.Module given by import path, batched unchanged with vmap."""

    model_config = ConfigDict(title="Your own single-sample module")

    impl: Literal["module"] = "module"
    target: str = Field(
        ...,
        description="Import path package.module:Class of a single-sample nn.Module.",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the constructor."
    )
    input_shape: tuple[int, ...] = Field(
        ..., min_length=1, description="Shape of one sample's input; must multiply to coef."
    )

    def imported_modules(self) -> list[str]:
        """The module of ``target``."""
        return [self.target.partition(":")[0]]


for _builtin in (
    NoModel,
    MultidimLinearModel,
    ModuleModel,
):
    catalog.add(_builtin)
