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
parallelism are). gradwatch never changes such a gradient: at step() it reduces a
private copy of their local pieces, all of them in one ``all_reduce`` per mesh dim
(``collectives.Collectives.reduce_partials``), and reads its statistics from that copy,
with the weight of a Replicate placement on those dims.
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


def local_piece(grad: torch.Tensor, world_size: int) -> tuple[torch.Tensor, float]:
    """(the local tensor to reduce, its weight in a world-wide sum) for one gradient; a Partial
    gradient's local piece is its pending sum (the caller reads a reduced private copy instead)."""
    if not is_dtensor(grad):
        return grad, 1.0 / world_size
    return grad.to_local(), piece_weight(grad, world_size)


def piece_weight(tensor: Any, world_size: int) -> float:
    """A DTensor's local piece's weight in a world-wide sum (Partial dims count as replicated: the
    weight of its reduced copy)."""
    return distinct_pieces(tensor.device_mesh, tuple(tensor.placements)) / world_size


def distinct_pieces(mesh: Any, placements: tuple) -> int:
    """How many distinct pieces a DTensor is cut into: the product of the sizes of the mesh dims
    it is sharded on. Any placement that neither replicates nor holds pending sums shards, also
    FSDP2's ``_StridedShard`` under tensor parallelism (whose ``is_shard()`` is False)."""
    pieces = 1
    for dim, placement in enumerate(placements):
        if not placement.is_replicate() and not placement.is_partial():
            pieces *= mesh.size(dim)
    return pieces
