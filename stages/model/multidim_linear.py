"""Single-sample PyTorch models shipped with gridsolve.

Models here are written for ONE sample, as users write theirs; the model stage
batches them unchanged with ``torch.func.vmap``. A model may name the dims of
its parameters, input and output in ``gridsolve_dims``; the output NetCDF uses
those names (otherwise ``<param>_d0``, …).
"""

from __future__ import annotations

import math
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
