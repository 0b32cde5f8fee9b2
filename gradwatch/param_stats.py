"""Fused reductions over the layers' parameter gradients, as they stand at step().

In the manner of ``torch.nn.utils.clip_grad``: gradients are grouped by device
and dtype and reduced with ``torch._foreach_*`` kernels (one launch per group
on accelerators), then scattered into per-layer rows with one ``index_add_`` /
``scatter_reduce_`` each. Nothing is copied from an accelerator to the host.

Non-finite counts: a tensor's sum of squares is finite exactly when all its
elements are finite, so the count is zero for free in the common case. On an
accelerator the count is computed every step (a cheap fused kernel there). On
the CPU, where an exact count costs 2-3 passes over every gradient, the sums
of squares are written into a tensor that shares memory with a numpy array;
reading it is a plain memory read of host memory, not a device sync, and the
count pass runs only for tensors whose sum of squares is not finite.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from .devices import IndexCache
from .layers import LayerSpec

_INF = float("inf")


# On the CPU, tensors at least this large are reduced one op each (BLAS dot and
# aminmax beat the foreach kernels there); smaller ones (biases, norms) go through
# one foreach call per group, which saves a Python dispatch per tensor.
_CPU_LARGE = 1 << 15


def _sq_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor sum of squares, accumulated in float32."""
    try:
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    except TypeError:  # torch < 2.5 has no dtype argument
        norms = [n.float() for n in torch._foreach_norm([g.float() for g in grads], 2)]
    return list(torch._foreach_mul(norms, norms))


def _abs_max(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor max |g| as one stacked tensor."""
    if grads[0].device.type == "cpu" and grads[0].numel() >= _CPU_LARGE:
        # The CPU inf-norm kernel is ~8x slower than aminmax; one pass each.
        pairs = [torch.aminmax(g) for g in grads]
        lo = torch.stack([p[0] for p in pairs])
        hi = torch.stack([p[1] for p in pairs])
        return torch.maximum(hi, lo.neg_())
    if grads[0].device.type == "cpu" and hasattr(torch, "_foreach_max"):
        return torch.stack(torch._foreach_max(torch._foreach_abs(grads)))
    return torch.stack(torch._foreach_norm(grads, _INF))


_GroupKey = tuple[torch.device, torch.dtype, bool]
_Group = tuple[list[torch.Tensor], "list[int] | tuple[int, ...]"]

# Temporaries of the non-finite count are bounded to this many elements at a time.
_COUNT_CHUNK = 1 << 24


def _nonfinite_counts(grads: list[torch.Tensor], chunk: int = _COUNT_CHUNK) -> torch.Tensor:
    """Per-tensor number of NaN/Inf elements, as one float32 tensor on the gradients' device.

    ``g - g`` is 0 for finite values and NaN for NaN/Inf, and the 0-"norm" counts the
    non-zeros. The gradients are cut into flat views of at most ``chunk`` elements and
    processed a batch of at most ``chunk`` elements at a time, so the temporaries never
    exceed ``chunk`` elements however large the model (a 7B-parameter model would
    otherwise allocate a second copy of all its gradients).
    """
    pieces: list[torch.Tensor] = []
    owners: list[int] = []
    for i, g in enumerate(grads):
        for piece in g.reshape(-1).split(chunk):
            pieces.append(piece)
            owners.append(i)
    counts: list[torch.Tensor] = []
    start, size = 0, 0
    for end, piece in enumerate(pieces + [None]):  # type: ignore[operator]
        if piece is None or (size + piece.numel() > chunk and end > start):
            batch = pieces[start:end]
            counts.extend(torch._foreach_norm(torch._foreach_sub(batch, batch), 0))
            start, size = end, 0
        if piece is not None:
            size += piece.numel()
    if len(pieces) > len(grads):  # add up the pieces of each split tensor
        per_tensor: list[list[torch.Tensor]] = [[] for _ in grads]
        for owner, count in zip(owners, counts):
            per_tensor[owner].append(count)
        counts = [c[0] if len(c) == 1 else torch.stack(c).sum() for c in per_tensor]
    return torch.stack(counts).to(torch.float32)


class ParamStats:
    """Per-layer sum of squares, max |g| and non-finite count of parameter gradients."""

    def __init__(self, layers: list[LayerSpec], device: torch.device) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.param_layer: list[int] = []
        for index, layer in enumerate(layers):
            for p in layer.params:
                self.params.append(p)
                self.param_layer.append(index)
        self.n_layers = len(layers)
        self.sharded = any(_is_dtensor(p) for p in self.params)
        self._owner_layers = IndexCache(device)  # parameters with a gradient -> their layers
        # Host memory shared with a tensor (CPU path only, see module docstring).
        self._cpu_sq = torch.zeros(len(self.params), dtype=torch.float32)
        self._cpu_sq_view = self._cpu_sq.numpy()
        # Large float32 CPU gradients: each op writes its result into a slot of
        # these (out=), which saves a stack and an allocation per statistic.
        self._cpu_lo = torch.zeros(len(self.params), dtype=torch.float32)
        self._cpu_hi = torch.zeros(len(self.params), dtype=torch.float32)
        self._slots = list(zip(self._cpu_sq.unbind(), self._cpu_lo.unbind(), self._cpu_hi.unbind()))
        self._heads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        # The grouping of a step where every parameter has a dense gradient.
        plan: dict[_GroupKey, list[int]] = defaultdict(list)
        self._plan_present = np.zeros(self.n_layers, dtype=np.int64)
        for j, p in enumerate(self.params):
            if p.numel() and not self.sharded:
                plan[_group_key(p)].append(j)
                self._plan_present[self.param_layer[j]] += 1
        self._plan = [(key, tuple(owners)) for key, owners in plan.items()]

    def record(
        self, sumsq_row: torch.Tensor, max_row: torch.Tensor, nonfinite_row: torch.Tensor
    ) -> np.ndarray:
        """Write this step's per-layer partials into the rows; returns params present per layer."""
        with torch.no_grad():  # gradients made with create_graph=True require grad themselves
            return self._record(sumsq_row, max_row, nonfinite_row)

    def _groups(self, grads: list[torch.Tensor | None]) -> tuple[dict[_GroupKey, _Group], np.ndarray]:
        """The gradients present, grouped by (device, dtype, large on CPU), with their owners."""
        if not self.sharded and self._plan and all(g is not None and not g.is_sparse for g in grads):
            # Every parameter has a dense gradient (the usual case): dense gradients have
            # their parameter's device, dtype and size, so the grouping is known in advance.
            planned = {key: ([grads[j] for j in owners], owners) for key, owners in self._plan}
            return planned, self._plan_present
        present = np.zeros(self.n_layers, dtype=np.int64)
        groups: dict[_GroupKey, _Group] = defaultdict(lambda: ([], []))
        for j, g in enumerate(grads):
            if g is None:
                continue
            if self.sharded and hasattr(g, "to_local"):
                g = g.to_local()  # FSDP2/DTensor: this rank's shard; partials summed at flush
            if g.is_sparse:
                g = g.coalesce()._values()
            if g.numel() == 0:
                continue
            group_grads, owners = groups[_group_key(g)]
            group_grads.append(g)
            owners.append(j)
            present[self.param_layer[j]] += 1
        return groups, present

    def _record(
        self, sumsq_row: torch.Tensor, max_row: torch.Tensor, nonfinite_row: torch.Tensor
    ) -> np.ndarray:
        groups, present = self._groups([p.grad for p in self.params])
        device = sumsq_row.device
        for (grad_device, dtype, large), (grads, owners) in groups.items():
            key = tuple(owners)  # the planned groups' owners are tuples already: no copy
            index = self._owner_layers.get(key, lambda: [self.param_layer[j] for j in key])
            if grad_device.type == "cpu":
                k = len(grads)
                if large and dtype == torch.float32:
                    sq, mx = self._cpu_large_float32(grads)
                else:
                    sq = torch.stack(_sq_norms(grads), out=self._head(k)[0])  # float32 already
                    mx = _abs_max(grads)
                    if mx.dtype != torch.float32:
                        mx = mx.to(torch.float32)
                bad = np.flatnonzero(~np.isfinite(self._cpu_sq_view[:k]))
                if len(bad):
                    counts = torch.zeros(k, dtype=torch.float32)
                    counts[bad] = _nonfinite_counts([grads[b] for b in bad])
                    nonfinite_row.index_add_(0, index, counts.to(device))
                if device.type != "cpu":  # CPU gradients, buffer elsewhere (a split model)
                    sq, mx = sq.to(device), mx.to(device)
            else:
                sq = torch.stack(_sq_norms(grads)).to(device=device, dtype=torch.float32)
                nf = _nonfinite_counts(grads).to(device=device, dtype=torch.float32)
                nonfinite_row.index_add_(0, index, nf)
                mx = _abs_max(grads).to(device=device, dtype=torch.float32)
            sumsq_row.index_add_(0, index, sq)
            max_row.scatter_reduce_(0, index, mx, "amax", include_self=True)
        return present

    def _cpu_large_float32(self, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sums of squares, max |g|) of large float32 CPU gradients: one BLAS dot and one aminmax each.

        On the CPU these beat the foreach kernels (the inf-norm kernel is ~8x slower
        than aminmax); aminmax goes first because it splits the tensor across the
        intra-op threads and leaves it in cache for the dot.
        """
        for (sq, lo, hi), g in zip(self._slots, grads):
            flat = g.reshape(-1)
            torch.aminmax(flat, out=(lo, hi))
            torch.dot(flat, flat, out=sq)
        sq, lo, hi = self._head(len(grads))
        return sq, torch.maximum(hi, lo.neg())

    def _head(self, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first ``k`` slots of the sums of squares, minima and maxima."""
        heads = self._heads.get(k)
        if heads is None:  # slicing is an op per call; the group sizes repeat
            heads = self._heads[k] = (self._cpu_sq[:k], self._cpu_lo[:k], self._cpu_hi[:k])
        return heads


def _group_key(tensor: torch.Tensor) -> _GroupKey:
    return (tensor.device, tensor.dtype, tensor.device.type == "cpu" and tensor.numel() >= _CPU_LARGE)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4, or no distributed support
        return False
    return isinstance(tensor, DTensor)
