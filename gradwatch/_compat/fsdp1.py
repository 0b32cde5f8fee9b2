"""FSDP1 (``FullyShardedDataParallel``): the user's parameters inside its flat shards.

With ``use_orig_params=True`` (Lightning's ``FSDPStrategy`` and Accelerate's default) each of the
model's parameters stays an ``nn.Parameter`` on its own module, but outside forward and backward it
holds this rank's piece of the parameter, flattened (empty on ranks that hold none of it), and its
``.grad`` that piece's gradient. gradwatch reads those pieces as it reads DTensor shards: their sums
of squares and non-finite counts are partial sums, their maxima partial maxima, combined over the
ranks at the flush with each distinct piece counted once. What it needs from FSDP1 is private:

- ``FullyShardedDataParallel._handle.flat_param``: the unit's ``FlatParameter``, its ``_params``
  (the original parameters, with ``use_orig_params=True``) and ``_shapes`` (their shapes);
- ``_handle._use_orig_params`` and ``_handle.process_group`` (the group a unit is sharded over:
  the intra-node group under hybrid sharding).

Fallback: a torch where these are missing raises :class:`UnsupportedSharding` at attach (never a
silent per-shard value). ``use_orig_params=False`` replaces the model's parameters by one flat
tensor per unit: refused at attach with the remedy.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

#: Module-name parts that FSDP1 and activation-checkpoint wrappers insert: layers are named by the model the user wrote.
WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")


class UnsupportedSharding(ValueError):
    """A sharded model gradwatch cannot read whole parameters of: raised at attach, with the remedy."""


@dataclass(frozen=True)
class ShardedParameter:
    """A parameter whose ``.grad`` on each rank is a piece of the whole.

    Args:
        shape: the whole parameter's shape.
        pieces: how many distinct pieces the world holds (the size of the group it is sharded over;
            each piece is held by world / pieces ranks).
    """

    shape: tuple[int, ...]
    pieces: int


def sharded_parameters(model: nn.Module) -> dict[int, ShardedParameter]:
    """id(parameter) -> its whole shape and pieces, for every parameter FSDP1 shards in ``model``
    (empty without FSDP1; ``NO_SHARD`` units hold whole parameters and are left out).

    Raises:
        UnsupportedSharding: FSDP1 with ``use_orig_params=False``, or a torch whose FSDP1 internals
            are not the ones read here.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # a build without distributed support
        return {}
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]
    found: dict[int, ShardedParameter] = {}
    for unit in units:
        handle = getattr(unit, "_handle", None)
        if handle is None:
            continue  # a unit without parameters of its own
        try:
            use_orig_params = bool(handle._use_orig_params)
            flat = handle.flat_param
            group_size = int(handle.process_group.size())
            params, shapes = flat._params, flat._shapes
        except AttributeError as exc:
            raise UnsupportedSharding(
                f"gradwatch reads FSDP1's flat parameters through internals this torch does not have ({exc}); "
                "use FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor parameters gradwatch reduces to "
                "the whole layers"
            ) from exc
        if not use_orig_params:
            raise UnsupportedSharding(
                "FSDP1 with use_orig_params=False replaces the model's parameters by one flat tensor per "
                "wrapped unit, so there are no per-layer gradients to read; pass use_orig_params=True "
                "(FullyShardedDataParallel(..., use_orig_params=True); Lightning: FSDPStrategy(use_orig_params=True), "
                "its default; Accelerate: fsdp_use_orig_params: true) or use FSDP2 (fully_shard)"
            )
        if unit.sharding_strategy == ShardingStrategy.NO_SHARD:
            continue  # whole parameters on every rank, as under DDP
        for p, shape in zip(params, shapes):
            found[id(p)] = ShardedParameter(tuple(int(s) for s in shape), group_size)
    return found


def strip_wrapper_parts(qualified: str) -> str:
    """A qualified module name without the parts FSDP1 and checkpoint wrappers insert."""
    if not any(part in qualified for part in WRAPPER_PARTS):
        return qualified
    return ".".join(part for part in qualified.split(".") if part not in WRAPPER_PARTS)

