"""How one rank's per-tensor sums add up to the world's when the model is sharded (``param_stats``).

Each rank writes its partial sums into the step's row; the flush's one collective adds them up.
For that sum to count each distinct piece of a gradient once, every column carries a weight: a
tensor whole on every rank 1/world, an FSDP1 piece pieces/world, a DTensor what its placements
say at each step (``distributed/sharding.py``). DTensor gradients still Partial on a replicated
mesh dim are reduced first, into a private copy (``p.grad`` is never replaced).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .devices import host_to_device
from .reductions import StepRows
from ..distributed.sharding import is_dtensor, is_partial, local_piece

#: Weight vectors kept for the distinct sets of DTensor weights met (one per step otherwise).
_CACHED = 16


class ShardedSums:
    """The weights and Partial reductions of one ``ParamStats``' columns.

    Args:
        params: the columns' parameters, in column order.
        pieces: per column, the pieces of its gradient over the ranks (0: whole).
        whole_ids: ids of parameters whole on this rank whose gradient is partitioned (ZeRO 1/2).
        world_size: the ranks the flush's sum runs over.
        reduce_partials: ``Collectives.reduce_partials`` (None: no collective may be made).
    """

    def __init__(self, params: list[torch.nn.Parameter], pieces: list[int], whole_ids: set[int], world_size: int,
                 reduce_partials: Callable[[list[torch.Tensor]], list[torch.Tensor] | None] | None) -> None:
        self.world_size = world_size
        self.base = np.array([count / world_size if count else 1.0 / world_size for count in pieces])
        self._whole_ids = whole_ids
        #: DTensor parameters replicated on some mesh dim: their gradients may be Partial there
        self.dtensors = [p for p in params if is_dtensor(p) and any(pl.is_replicate() for pl in p.placements)]
        self._reduce_partials = reduce_partials
        self._cache: dict[tuple, torch.Tensor] = {}

    def reduced_partials(self) -> dict[int, torch.Tensor]:
        """id(gradient) -> its reduced private copy, for the Partial gradients (read-only: ``p.grad``
        is never replaced); empty where no collective may be made (their pending sums are read)."""
        if not self.dtensors:
            return {}
        partial = [p.grad for p in self.dtensors if is_partial(p.grad)]
        reduced = self._reduce_partials(partial) if partial and self._reduce_partials is not None else None
        return {} if reduced is None else {id(g): r for g, r in zip(partial, reduced)}

    def apply(self, rows: StepRows, weights: list[tuple[int, float]]) -> None:
        """Weight this rank's sums so that one world-wide sum counts each distinct piece once
        (``weights``: the DTensor columns' (column, weight) of this step)."""
        key = tuple(weights)
        tensor = self._cache.get(key)
        if tensor is None:
            values = self.base.copy()
            for column, weight in weights:
                values[column] = weight
            tensor = host_to_device(values, rows.sq.device, rows.sq.dtype)
            if len(self._cache) < _CACHED:
                self._cache[key] = tensor
        rows.sq.mul_(tensor)
        rows.nonfinite.mul_(tensor)

    def param_weights(self, params: list[torch.nn.Parameter]) -> np.ndarray:
        """Each column's weight in a world-wide sum of its *parameter's* pieces (see sharding.py): a
        ZeRO parameter is whole on every rank (only its gradient is partitioned): 1/world."""
        return np.array([local_piece(p, self.world_size)[1] if is_dtensor(p)
                         else 1.0 / self.world_size if id(p) in self._whole_ids else base
                         for p, base in zip(params, self.base)])  # fmt: skip

    def drop_references(self) -> None:
        """Forget the parameters (close())."""
        self.dtensors, self._whole_ids = [], set()
