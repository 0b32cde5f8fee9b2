"""Sharded gradients (FSDP2, tensor parallel, any DTensor): local pieces and their weights.

A DTensor gradient is held as one local piece per rank. Its sum of squares and
its non-finite count are sums over the *distinct* pieces; its maximum is the
maximum over them. The flush reduces every such partial with one world-wide
collective per reduction kind, so each rank's partial is weighted by

    weight = (number of distinct pieces) / (world size)

where the number of distinct pieces is the product of the mesh sizes of the
dimensions the tensor is sharded on. A piece replicated R times across the
world then contributes R x weight x value = its value once: partials are
combined over the mesh dimensions on which the tensor is sharded, never over
replicated ones (a 2x2 replicate x shard mesh: each shard is counted once, not
twice). A plain tensor in a sharded model is replicated everywhere: weight
1/world. Maxima need no weight (a maximum over copies is the maximum).

A gradient with a ``Partial`` placement holds pending sums, whose squares do not
add up (FSDP2 gradients are never Partial; those of the norms under sequence
parallelism are). They are reduced to ``Replicate`` in step(), all of them in one
``all_reduce`` per mesh dim (:func:`reduce_partials`, not one collective per tensor),
and the reduced gradients replace ``p.grad``: the optimizer would make that same
reduction at its step (a Replicate parameter cannot be updated by a Partial
gradient), tensor by tensor, so it is moved earlier and batched, not added.
"""

from __future__ import annotations

from typing import Any

import torch


try:  # resolved once: the taps test outputs against it without an import in traced code
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch < 2.4, or a build without distributed support
    _DTensor = None  # type: ignore[assignment,misc]


def is_dtensor(tensor: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor``."""
    return _DTensor is not None and isinstance(tensor, _DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (a module output, its gradient); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_partial(tensor: Any) -> bool:
    """A DTensor holding pending sums on some mesh dim."""
    return is_dtensor(tensor) and any(p.is_partial() for p in tensor.placements)


def reduce_partials(params: list[torch.nn.Parameter]) -> None:
    """Replace every Partial(sum) DTensor gradient of ``params`` by its Replicate reduction: one
    ``all_reduce`` per (mesh, Partial mesh dims, dtype) over all of them (other reduce ops: one
    redistribute each)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    batches: dict[tuple, list[torch.nn.Parameter]] = {}
    for p in params:
        g = p.grad
        if not is_partial(g):
            continue
        if any(pl.is_partial() and getattr(pl, "reduce_op", "sum") != "sum" for pl in g.placements):
            p.grad = reduce_partial(g)
            continue
        dims = tuple(d for d, pl in enumerate(g.placements) if pl.is_partial())
        batches.setdefault((id(g.device_mesh), dims, g.dtype), []).append(p)
    for (_, dims, _), members in batches.items():
        grads = [p.grad for p in members]
        mesh = grads[0].device_mesh
        pieces = [g.to_local() for g in grads]
        flat = torch.cat([piece.reshape(-1) for piece in pieces])
        for dim in dims:
            dist.all_reduce(flat, group=mesh.get_group(dim))
        offset = 0
        for p, g, piece in zip(members, grads, pieces):
            n = piece.numel()
            reduced = flat[offset : offset + n].view(piece.shape)
            offset += n
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            p.grad = DTensor.from_local(reduced, mesh, placements, run_check=False, shape=g.shape, stride=g.stride())


def reduce_partial(grad: torch.Tensor) -> torch.Tensor:
    """A Partial DTensor gradient reduced to Replicate on its Partial mesh dims (one collective)."""
    from torch.distributed.tensor import Replicate

    return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])


def local_piece(grad: torch.Tensor, world_size: int) -> tuple[torch.Tensor, float]:
    """(the local tensor to reduce, its weight in a world-wide sum) for one gradient."""
    if not is_dtensor(grad):
        return grad, 1.0 / world_size
    if is_partial(grad):
        grad = reduce_partial(grad)
    return grad.to_local(), distinct_pieces(grad.device_mesh, tuple(grad.placements)) / world_size


def distinct_pieces(mesh: Any, placements: tuple) -> int:
    """How many distinct pieces a DTensor is cut into: the product of the sizes of the mesh dims
    it is sharded on. Any placement that neither replicates nor holds pending sums shards, also
    FSDP2's ``_StridedShard`` under tensor parallelism (whose ``is_shard()`` is False)."""
    pieces = 1
    for dim, placement in enumerate(placements):
        if not placement.is_replicate() and not placement.is_partial():
            pieces *= mesh.size(dim)
    return pieces
