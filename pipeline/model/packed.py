"""Inference-only weight layout for CPUs: linear weights stored transposed, [in, out].

On a CPU, `F.linear(x, W)` with the checkpoint's [out, in] weight switches to a slower kernel
from 4 input rows on (one thread, demo model: its 6,144 x 256 output projection takes 0.45 ms
for 4 rows against 0.24 ms for 1), so verifying gamma + 1 >= 4 tokens cost 1.4x a 1-token
step. `x @ W_t` with W_t [in, out] contiguous stays flat in the rows (0.25 ms at 4, 0.28 at 8)
and is no slower at batch 48 (docs/decisions.md, 2026-12-01). CUDA's GEMMs take either layout,
so the loader packs on CPU only.
"""
from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x @ weight_t (+ bias); weight_t: [in, out] contiguous."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: [..., in] -> [..., out]
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def pack_linears_(module: nn.Module) -> None:
    """Replace every nn.Linear under `module` by a PackedLinear (in place)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
        else:
            pack_linears_(child)


def packing_pays(device: torch.device) -> bool:
    """Measured on CPU only (module docstring)."""
    return torch.device(device).type == "cpu"
