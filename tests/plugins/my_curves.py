"""A user's single-pixel curves (``solve: {impl: curvefit}``), outside gridsolve's packages."""

from __future__ import annotations

import torch
from torch import nn


def season(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Double logistic NDVI season of ONE pixel: green-up at p[3], senescence at p[5]."""
    return p[0] + p[1] * (torch.sigmoid(p[2] * (t - p[3])) - torch.sigmoid(p[4] * (t - p[5])))


class Recovery(nn.Module):
    """Exponential recovery after a disturbance at ``t0``: level p[0], depth p[1], scale p[2]."""

    def __init__(self, t0: float = 0.0) -> None:
        super().__init__()
        self.t0 = t0

    def forward(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return p[0] - p[1] * torch.exp(-(t - self.t0) / p[2])


def reads_a_number(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrong: ``.item()`` cannot run under vmap."""
    return t * p[0].item()


def one_value(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Wrong: one value per pixel, not one per observation."""
    return (p[0] * t).sum()


def line(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A straight line: a linear least-squares problem the nonlinear fit must solve too."""
    return p[0] + p[1] * t


def undefined_before_start(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """A level that only exists from ``p[1]`` on: NaN before (sqrt of a negative)."""
    return p[0] + 0.0 * torch.sqrt(t - p[1])
