"""Tensor parallelism: which layers' outputs are split across ranks, and which are repeated.

``parallelize_module`` turns a layer's parameters into DTensors on a tensor-parallel
mesh. Its output then comes in one of three forms, which decide how the ranks' output
statistics combine:

- **split units** (``ColwiseParallel``: the weight is ``Shard`` on its unit dim, dim 0 of
  a Linear or conv weight, dim 1 of an Embedding's, and the output stays sharded on its
  last dim): each rank holds a slice of the units. Sums of squares add up over the
  slices, and each rank's per-unit evidence belongs to its own units, at its offset.
- **repeated** (``RowwiseParallel`` with its default ``Replicate`` output, and every
  layer whose parameters are plain tensors): every rank of the group holds the same
  output, which must be counted once.
- **split rows** (``SequenceParallel``, and a style whose ``output_layouts`` shards
  another dim than the last, e.g. ``RowwiseParallel(output_layouts=Shard(1))`` under
  sequence parallelism): each rank holds other tokens of every unit, which add up like
  data-parallel rows.

Split units and repeated outputs come from one batch, so their output-gradient calls and
samples are counted once per group. The form is read from the output layout the module's
parallel style declared (in the forward hook ``parallelize_module`` registers: torch's
private layout, read once at attach), else from the weight's placement (split units when
it is sharded on its unit dim). Under FSDP2 on top (a 2-D data x tensor mesh) the
tensor-parallel placement is the one FSDP keeps for the unsharded parameter; FSDP's own
dim is data parallelism, whose ranks see different data and add up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..capture.layers import LayerSpec
from .._compat import parallel
from .sharding import is_dtensor


@dataclass
class OutputShare:
    """How one layer's output is spread over its tensor-parallel group, seen from this rank."""

    units: int  # the layer's units (whole layer)
    unit_offset: int = 0  # where this rank's units start in the layer
    #: weight of this rank's output-gradient sum of squares and unit evidence in a world-wide sum
    out_weight: float = 1.0
    #: weight of its output-gradient calls, samples and forward sums (the group saw one batch)
    count_weight: float = 1.0


def output_shares(model: nn.Module, layers: list[LayerSpec]) -> list[OutputShare] | None:
    """Per layer, how its output is shared over tensor-parallel ranks; None without tensor parallelism.

    Sets ``layer.units`` of a split layer to this rank's slice, so that its taps judge the
    output the rank really holds.
    """
    fsdp_specs = parallel.fsdp_tensor_parallel_specs(model)
    specs = [_layer_spec(layer, fsdp_specs) for layer in layers]
    group = max((spec.mesh.size() for spec in specs if spec is not None), default=1)
    if group == 1:
        return None
    declared = [layer.units for layer in layers]
    try:
        return _shares(layers, specs, group)
    except Exception:
        for layer, units in zip(layers, declared):  # as if no layer were split
            layer.units = units
        raise


def _shares(layers: list[LayerSpec], specs: list[Any], group: int) -> list[OutputShare]:
    shares = []
    for layer, spec in zip(layers, specs):
        share = OutputShare(units=layer.units, out_weight=1.0 / group, count_weight=1.0 / group)
        layout = parallel.declared_output(layer.module)
        if layout == "rows":  # each rank holds other rows of every unit: they add up
            share.out_weight = share.count_weight = 1.0
        elif spec is not None and layout in (None, "units"):
            _split_units(layer, spec, share)
        shares.append(share)
    return shares


def _split_units(layer: LayerSpec, spec: Any, share: OutputShare) -> None:
    """A layer whose weight is sharded on its unit dim: this rank's units and their weight."""
    weight = _weight(layer)
    dim = 1 if isinstance(layer.module, nn.Embedding) else 0
    if weight.ndim <= dim or layer.units == 0 or weight.shape[dim] != layer.units:
        return
    mesh, placements = spec.mesh, spec.placements
    pieces = 1
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard(dim):
            pieces *= mesh.size(mesh_dim)
    if pieces == 1:
        return
    local_shape, offset = parallel.local_shape_and_offset(tuple(weight.shape), mesh, placements)
    share.out_weight = pieces / mesh.size()
    share.count_weight = 1.0 / mesh.size()
    share.unit_offset = int(offset[dim])
    layer.units = int(local_shape[dim])


def _weight(layer: LayerSpec) -> Any:
    """The layer's weight: its first parameter of two dims or more, else its first."""
    return next((p for p in layer.params if p.ndim >= 2), layer.params[0])


def _layer_spec(layer: LayerSpec, fsdp_specs: dict[int, Any]) -> Any:
    """The tensor-parallel DTensorSpec of the layer's weight (mesh and placements), or None."""
    weight = _weight(layer)
    if id(weight) in fsdp_specs:
        return fsdp_specs[id(weight)]
    return parallel.dtensor_spec(weight) if is_dtensor(weight) else None
