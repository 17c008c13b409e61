"""Single-sample PyTorch models shipped with gridsolve.

Models here are written for ONE sample, as users write theirs; the model stage
batches them unchanged with ``torch.func.vmap``. A model may name the dims of
its parameters, input and output in ``gridsolve_dims``; the output NetCDF uses
those names (otherwise ``<param>_d0``, …).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar

import torch
from torch import nn


class MultidimLinear(nn.Module):
    """``tensordot(x, weight, dims=2) + bias`` for one sample ``x (input_dim, hidden_dim)``."""

    gridsolve_dims: ClassVar[dict[str, tuple[str, ...]]] = {
        "weight": ("input_dim", "hidden_dim", "output"),
        "bias": ("output",),
        "input": ("input_dim", "hidden_dim"),
        "output": ("output",),
    }

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(input_dim * hidden_dim)
        self.weight = nn.Parameter(
            torch.empty(input_dim, hidden_dim, output_dim).uniform_(-bound, bound)
        )
        self.bias = nn.Parameter(torch.empty(output_dim).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Outputs (output_dim,) of one sample."""
        out: torch.Tensor = torch.tensordot(x, self.weight, dims=2) + self.bias
        return out

    def per_sample_parameter_gradients(
        self, x: torch.Tensor, dl: torch.Tensor, out: Mapping[str, torch.Tensor]
    ) -> None:
        """Each sample's gradient of Σ_k dl_k·y_k with respect to weight (and bias), into ``out``.

        Samples are the last dim of every array (the stored layout): ``x`` (…, m)
        holds input elements of every sample (all of them: (input_dim,
        hidden_dim, m)), ``dl`` (output_dim, m); ``out["weight"]`` (…,
        output_dim, m) gets the weight's gradient for those elements, and
        ``out["bias"]`` (output_dim, m), if given, the bias's.
        """
        torch.mul(x.unsqueeze(-2), dl, out=out["weight"])
        if "bias" in out:
            out["bias"].copy_(dl)
