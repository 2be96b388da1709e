"""Model factories for `python -m profiling.export package.module:factory` tests."""

from __future__ import annotations

import torch
from torch import nn

from models import ModelSpec


class DataDependent(nn.Module):
    """Branches on a tensor value: fine on real tensors, impossible under fake tensors."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = self.first(x)
        if x.sum().item() > 0:
            x = x * 2
        return self.second(x).sum()


def data_dependent_spec() -> ModelSpec:
    return ModelSpec(
        name="data-dependent",
        config=None,
        build=DataDependent,
        example_inputs=lambda batch, seq: (torch.randn(batch, 8),),
        layers=["first", "second"],
        seq_len=None,
    )
