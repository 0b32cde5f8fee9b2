"""A model split across ranks (pipeline stages, tensor parallelism): one layout agreed by all.

Each rank monitors the layers it holds. At attach every rank describes them (one
``all_gather_object``, once) and all agree on the **union**: every layer of every rank,
ordered rank by rank (pipeline stage i on rank i: the forward order across stages), each
layer and parameter tensor owned by the ranks that hold it. A layer name held with
different units or parameter shapes on two ranks is a real mismatch (:func:`conflicts`).

The per-step path does not change: each rank records its own layers into its own
buffer (``layout.py``). At a flush, :meth:`MeshLayout.gather` copies that buffer into
the union's, each value weighted so that one world-wide sum combines every layer over
the ranks that hold it:

- a parameter tensor: a plain tensor held by ``h`` ranks (data-parallel replicas of a
  stage) weighs ``1/h``; a DTensor's local piece weighs ``pieces/h`` (see sharding.py),
  so shard partials add up over the mesh dims it is sharded on and replicas count once;
- a layer's output gradients and forward sums: summed over the ranks that ran it, as
  micro-batches and data-parallel replicas are, except within a tensor-parallel group,
  which saw one batch (``tensor_parallel.py``: split outputs add up, repeated ones count once);
- the forward clock: each rank's values are lifted by its stage's position, so that the
  forward order runs across stages.

Then the union buffer is reduced (one collective per reduction kind, as before) and
decoded like any layout: :class:`MeshLayout` has the attributes ``decode.build_window``
reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..capture.buffer import StatBuffer
from ..capture.devices import host_to_device, index_tensor
from ..capture.host_cells import CLOCK_SPAN
from ..capture.layers import LayerSpec
from ..capture.layout import Layout, starts
from ..capture.param_stats import ParamStats
from ..registry.states import Sizes, StateDecl, declare_states, declared
from .tensor_parallel import OutputShare

#: A stage's forward clock values are lifted by (stages after it) x this: more than a clock runs in a step.
_STAGE_SPAN = 2 * CLOCK_SPAN


@dataclass
class LayerDescription:
    """One rank's layer, as the other ranks need to know it."""

    name: str
    units: int  # the whole layer's units
    shapes: tuple[tuple[int, ...], ...]  # the (global) shapes of its parameters, in order
    unit_offset: int  # where this rank's units start (tensor parallel), else 0
    local_units: int
    out_weight: float
    count_weight: float


@dataclass
class RankDescription:
    """What one rank monitors: its layers, and each of its buffer columns as (layer name, parameter index)."""

    layers: list[LayerDescription]
    columns: list[tuple[str, int]]
    sample_columns: list[int]  # indices into ``columns`` sampled for the per-step update estimate
    sample_numel: list[int]
    track_updates: bool
    counts_every_step: bool
    sharded: bool

    def signature(self) -> tuple:
        """Equal on two ranks exactly when they hold the same layout and no output is shared."""
        return (
            [(d.name, d.units, d.shapes, d.unit_offset, d.local_units, d.out_weight, d.count_weight) for d in self.layers],
            self.columns, self.track_updates,
        )  # fmt: skip


def describe_rank(layers: list[LayerSpec], param_stats: ParamStats, layout: Layout,
             shares: list[OutputShare] | None) -> RankDescription:  # fmt: skip
    """This rank's description (before any collective)."""
    described = []
    for i, layer in enumerate(layers):
        share = shares[i] if shares is not None else OutputShare(units=layer.units)
        described.append(
            LayerDescription(
                name=layer.name, units=share.units, shapes=tuple(layer.shapes),
                unit_offset=share.unit_offset, local_units=int(layout.unit_count[i]),
                out_weight=share.out_weight, count_weight=share.count_weight,
            )
        )  # fmt: skip
    position = {}
    for layer in layers:
        for k, p in enumerate(layer.params):
            position[id(p)] = (layer.name, k)
    return RankDescription(
        layers=described,
        columns=[position[id(p)] for p in param_stats.params],
        sample_columns=[int(j) for j in layout.sample_columns],
        sample_numel=[int(n) for n in layout.sample_numel],
        track_updates=layout.track_updates,
        counts_every_step=bool(layout.counts_every_step),
        sharded=param_stats.sharded,
    )


def conflicts(ranks: list[RankDescription]) -> list[str]:
    """Layer names held with different units or parameter shapes on two ranks, as readable lines."""
    first_seen: dict[str, tuple[int, LayerDescription]] = {}
    found: dict[str, str] = {}
    for rank, description in enumerate(ranks):
        for layer in description.layers:
            first_rank, first = first_seen.setdefault(layer.name, (rank, layer))
            if (first.units, first.shapes) != (layer.units, layer.shapes) and layer.name not in found:
                found[layer.name] = (
                    f"{layer.name}: {first.units} units, parameter shapes {list(first.shapes)} on rank {first_rank}, "
                    f"but {layer.units} units, parameter shapes {list(layer.shapes)} on rank {rank}"
                )
    return list(found.values())


class MeshLayout:
    """The union of every rank's layers: its declared states, and how this rank's buffer maps into them.

    Duck-typed as a :class:`layout.Layout` for ``decode.build_window``.
    """

    def __init__(self, ranks: list[RankDescription], rank: int, local: Layout) -> None:
        self.flush_every = local.flush_every
        self.counts_every_step = all(r.counts_every_step for r in ranks)
        self.track_updates = any(r.track_updates for r in ranks)

        # Layers in rank order (stage 0's first), each once; a stage's position is that of its first layer.
        index: dict[str, int] = {}
        units: list[int] = []
        shapes: list[tuple] = []
        for description in ranks:
            for layer in description.layers:
                if layer.name not in index:
                    index[layer.name] = len(index)
                    units.append(layer.units)
                    shapes.append(layer.shapes)
        self.names = list(index)
        n = len(self.names)
        self.unit_count = np.array(units, dtype=np.int64)
        self.unit_offset = starts(self.unit_count)
        column_of, holders, sample_order = self._columns(ranks, index, shapes)
        device = self._map_rank(ranks, rank, local, index, column_of, holders, sample_order)

        # Every state a sum (or a maximum) over the ranks, weighted by gather(); the host's counts
        # arrive on the device with the rest of the rank's buffer.
        self.buffer = StatBuffer(device)
        self._sizes = Sizes(local.flush_every, len(self.param_layer), n, int(self.unit_count.sum()), len(sample_order),
                            self.track_updates)  # fmt: skip
        declare_states(self.buffer, self._sizes, union=True, sharded=False)

    def _columns(self, ranks: list[RankDescription], index: dict[str, int],
                 shapes: list[tuple]) -> tuple[dict[tuple[str, int], int], np.ndarray, list[int]]:  # fmt: skip
        """Every layer's parameter tensors as columns, in order; how many ranks hold each; the update
        sample's columns. Returns (column of (layer, k), holders per column, sampled columns in order)."""
        # Columns: every layer's parameters in order; held by the ranks that list them.
        column_of: dict[tuple[str, int], int] = {}
        owner, numel, ndim = [], [], []
        for name, layer_shapes in zip(self.names, shapes):
            for k, shape in enumerate(layer_shapes):
                column_of[(name, k)] = len(owner)
                owner.append(index[name])
                numel.append(int(np.prod(shape)) if shape else 1)
                ndim.append(len(shape))
        self.param_layer = np.array(owner, dtype=np.int64)
        self.tensor_numel = np.array(numel, dtype=np.int64)
        self.param_ndim = np.array(ndim, dtype=np.int64)
        self.param_numel = np.zeros(len(self.names), dtype=np.int64)
        np.add.at(self.param_numel, self.param_layer, self.tensor_numel)
        holders = np.zeros(len(owner), dtype=np.int64)
        for description in ranks:
            for key in description.columns:
                holders[column_of[key]] += 1

        sampled_keys = {}
        for description in ranks:
            for j, count in zip(description.sample_columns, description.sample_numel):
                sampled_keys.setdefault(column_of[description.columns[j]], count)
        sample_order = sorted(sampled_keys)
        self.sample_columns = np.array(sample_order, dtype=np.int64)
        self.sample_numel = np.array([sampled_keys[c] for c in sample_order], dtype=np.int64)
        return column_of, holders, sample_order

    def _map_rank(self, ranks: list[RankDescription], rank: int, local: Layout, index: dict[str, int],
                  column_of: dict[tuple[str, int], int], holders: np.ndarray, sample_order: list[int]) -> torch.device:  # fmt: skip
        """Where this rank's states go in the union's, and with which weights; returns the device."""
        mine, n = ranks[rank], len(self.names)
        # This rank's states -> the union's: indices and weights.
        world = len(ranks)
        mine_cols = np.array([column_of[key] for key in mine.columns], dtype=np.int64)
        # A local sum already carries its sharded weight (pieces / world, sharding.py) when the rank's
        # model is sharded, none otherwise: the factor that makes it pieces / holders.
        factor = (world if mine.sharded else 1.0) / holders[mine_cols]
        mine_layers = np.array([index[d.name] for d in mine.layers], dtype=np.int64)
        out_w = np.array([d.out_weight for d in mine.layers])
        count_w = np.array([d.count_weight for d in mine.layers])
        unit_index = [
            np.arange(d.local_units) + self.unit_offset[index[d.name]] + d.unit_offset
            for d in mine.layers if d.local_units
        ]  # fmt: skip
        unit_weight = [np.full(d.local_units, d.out_weight) for d in mine.layers if d.local_units]
        stage = min((index[d.name] for d in mine.layers), default=0)
        position = {c: s for s, c in enumerate(sample_order)}
        mine_samples = np.array([position[column_of[mine.columns[j]]] for j in mine.sample_columns], dtype=np.int64)

        dtype, device = local.buffer.dtype, local.device
        self._local = local
        self._column_index = index_tensor(mine_cols, device)
        self._column_factor = host_to_device(factor, device, dtype)
        self._layers = index_tensor(mine_layers, device)
        self._out_weights = host_to_device(np.stack([out_w, count_w, count_w]), device, dtype)  # [3, l]
        self._count_weights = host_to_device(count_w, device, dtype)
        self._units = index_tensor(np.concatenate(unit_index) if unit_index else np.zeros(0), device)
        self._unit_weights = host_to_device(
            np.concatenate(unit_weight) if unit_weight else np.zeros(0), device, dtype
        )
        self._stage_lift = (n - stage) * _STAGE_SPAN
        self._samples = index_tensor(mine_samples, device)
        self._sample_factor = host_to_device(1.0 / holders[mine_cols[mine.sample_columns]], device, dtype)
        return device

    def gather(self, combined: bool = True) -> None:
        """Copy this rank's buffer (host states loaded) into the union's; reduce ``self.buffer`` next.

        Every state is placed and weighted as ``registry/states.py`` declares it.
        ``combined=False``: no reduction follows (cross-process reduction turned off): this rank's
        own values, unweighted, in the union's places, the other ranks' layers empty.
        """
        local, union = self._local.buffer, self.buffer
        union.zero_()
        index = {"param": self._column_index, "layer": self._layers, "unit": self._units, "sample": self._samples}
        for state in declared(self._sizes):
            if state.needs == "updates" and not self._local.track_updates:
                continue  # no optimizer on this rank: its layout has no update states
            values = self._weighted(state, local[state.name], combined)
            if state.union_index is None:
                union[state.name].copy_(values)
            else:
                union[state.name].index_copy_(state.dims.index(state.union_index), index[state.union_index], values)

    def _weighted(self, state: StateDecl, values: torch.Tensor, combined: bool) -> torch.Tensor:
        """A rank's values of ``state`` as the union weighs them (``StateDecl.union_weight``)."""
        how = state.union_weight
        if how == "stage":  # the forward clock runs across stages, with or without a reduction
            return torch.where(values > 0, values + self._stage_lift, values)
        if how is None or not combined:
            return values
        weights = {"column": self._column_factor, "output": self._out_weights, "count": self._count_weights,
                   "unit": self._unit_weights, "sample": self._sample_factor}[how]  # fmt: skip
        # weights cover the indexed dimension (and, for "output", the one before it): align them
        trailing = len(state.dims) - state.dims.index(state.union_index) - 1
        return values * weights.view(*weights.shape, *([1] * trailing))
