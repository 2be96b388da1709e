"""The layer's own gradients beside its backward transient (``backward_grad_moments``,
``profiling.trace.own_grads``), checked against hand counts.

Sizes: b 4, fp32; a block is fc1 (8 -> 16) and fc2 (16 -> 8): fc1 128 + 16 parameters, fc2
128 + 8; TP splits fc1 (column-parallel, weight and bias) and fc2's weight (row-parallel).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from profiling.trace.profile import profile_module  # noqa: E402
from solver.errors import InputError  # noqa: E402
from solver.graph import graph_from_dict  # noqa: E402


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.b0, self.b1 = Block(), Block()

    def forward(self, x):
        return self.b1(self.b0(x))


@pytest.mark.parametrize("mode", ["fake", "real"])
def test_backward_grad_moments_hand_count(mode):
    torch.manual_seed(0)
    graph = profile_module(
        TwoBlocks(), (torch.randn(4, 8),), model_name="two", mode=mode, layers=["b0", "b1"]
    )
    b0, b1 = graph.layers
    # b0's backward: fc2's node makes its weight and bias gradients (136 parameters, 128 of
    # them TP-split) and its input gradient [4, 16] (256 B); ReLU's backward then makes
    # [4, 16] (256 B) while both live, the received output gradient [4, 8] (128 B) freed:
    # (256 + 256 - 128) / 4 = 96 per sample, the layer's peak. Then fc2's input gradient is
    # freed and ReLU's saved output [4, 16] released (its saved storage, deducted), and fc1's
    # node makes the other 144 parameters' gradients (all split) and no input gradient (x
    # needs none): 384 - 256 - 256 = -128, -32 per sample.
    assert b0.backward_grad_moments == [(136, 128, 96), (280, 272, -32)]
    assert b0.transient_bytes == 96 and b0.params == 280 and b0.tp_params == 272
    assert [point[:2] for point in b1.backward_grad_moments] == [(136, 128), (280, 272)]
    # the largest moment's bytes are the backward's peak (here the layer's peak)
    assert max(point[2] for point in b1.backward_grad_moments) == b1.transient_bytes
    # b1's last moment: fc1's input gradient [4, 8] (128 B) and the loss's scalar gradient
    assert b1.backward_grad_moments[-1][2] == -(-(128 + 4) // 4)


def test_backward_grad_moments_round_trip_and_checks():
    document = {
        "format": "layer-graph",
        "version": 1,
        "model": "m",
        "layers": [
            {
                "name": "a",
                "params": 10,
                "tp_params": 4,
                "activation_bytes": 8,
                "output_bytes": 8,
                "transient_bytes": 20,
                "backward_grad_moments": [[3, 2, 20], [10, 4, 5]],
            }
        ],
    }
    graph = graph_from_dict(document, origin="t")
    assert graph.layers[0].backward_grad_moments == [(3, 2, 20), (10, 4, 5)]
    again = graph_from_dict(graph.to_dict(), origin="t")
    assert again.layers[0].backward_grad_moments == [(3, 2, 20), (10, 4, 5)]
    bad = (([11, 0, 1], "params"), ([3, 4, 1], "tp_params"), ([1, 0, 21], "transient"))
    for point, word in bad:
        document["layers"][0]["backward_grad_moments"] = [point]
        with pytest.raises(InputError, match=word):
            graph_from_dict(document, origin="t")
