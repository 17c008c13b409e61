"""A user's single-sample model living outside gridsolve's packages."""

from __future__ import annotations

import torch
from torch import nn


class TinyMLP(nn.Module):
    """x (n_in,) → tanh(W1 x + b1) → W2 · + b2 → (n_out,), for ONE sample."""

    def __init__(self, n_in: int, hidden: int = 5, n_out: int = 2) -> None:
        super().__init__()
        self.layer1 = nn.Linear(n_in, hidden)
        self.layer2 = nn.Linear(hidden, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


class Batched(nn.Module):
    """A model that (wrongly) assumes a batch dim: fails on one sample."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 0, 0] * self.w.sum()
