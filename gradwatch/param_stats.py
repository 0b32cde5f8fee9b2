"""Fused reductions over the layers' parameter gradients, as they stand at step().

In the manner of ``torch.nn.utils.clip_grad``: gradients are grouped by device
and dtype and reduced with ``torch._foreach_*`` kernels, then scattered into
per-layer rows with one ``index_add_``/``index_reduce_`` each. No value is read
back to the host.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .layers import LayerSpec

_INF = float("inf")


def _foreach_sq_norm(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_norm(grads, 2, dtype=torch.float32))
    except TypeError:  # torch < 2.5 has no dtype argument
        return [n.float() for n in torch._foreach_norm([g.float() for g in grads], 2)]


def _foreach_abs_max(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    if grads[0].device.type == "cpu":
        # The CPU inf-norm kernel is ~8x slower than aminmax; one pass each.
        out = []
        for g in grads:
            lo, hi = torch.aminmax(g)
            out.append(torch.maximum(hi, -lo))
        return out
    return list(torch._foreach_norm(grads, _INF))


def _foreach_nonfinite_count(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    # g - g is 0 for finite values and NaN for NaN/Inf; the 0-"norm" counts the NaNs.
    return list(torch._foreach_norm(torch._foreach_sub(grads, grads), 0))


class ParamStats:
    """Per-layer sum of squares, max |g| and non-finite count of parameter gradients."""

    def __init__(self, layers: list[LayerSpec]) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.param_layer: list[int] = []
        for index, layer in enumerate(layers):
            for p in layer.params:
                self.params.append(p)
                self.param_layer.append(index)
        self.n_layers = len(layers)
        self._index_cache: dict[tuple[int, ...], torch.Tensor] = {}

    def record(
        self, sumsq_row: torch.Tensor, max_row: torch.Tensor, nonfinite_row: torch.Tensor
    ) -> np.ndarray:
        """Write this step's per-layer partials into the rows; returns params present per layer."""
        present = np.zeros(self.n_layers, dtype=np.int64)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor], list[int]]] = (
            defaultdict(lambda: ([], []))
        )
        for j, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                g = g.coalesce()._values()
            if g.numel() == 0:
                continue
            grads, owners = groups[(g.device, g.dtype)]
            grads.append(g.detach())
            owners.append(j)
            present[self.param_layer[j]] += 1
        device = sumsq_row.device
        for (_, _), (grads, owners) in groups.items():
            index = self._layer_index(tuple(owners), device)
            sq = torch.stack(_foreach_sq_norm(grads)).to(device).square_()
            mx = torch.stack(_foreach_abs_max(grads)).to(device=device, dtype=torch.float32)
            nf = torch.stack(_foreach_nonfinite_count(grads)).to(device=device, dtype=torch.float32)
            sumsq_row.index_add_(0, index, sq)
            nonfinite_row.index_add_(0, index, nf)
            max_row.scatter_reduce_(0, index, mx, "amax", include_self=True)
        return present

    def _layer_index(self, owners: tuple[int, ...], device: torch.device) -> torch.Tensor:
        index = self._index_cache.get(owners)
        if index is None:
            index = torch.tensor([self.param_layer[j] for j in owners], device=device)
            if len(self._index_cache) < 64:
                self._index_cache[owners] = index
        return index
