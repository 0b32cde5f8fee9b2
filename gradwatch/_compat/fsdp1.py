"""FSDP1 (``FullyShardedDataParallel``): the user's parameters inside its flat shards.

With ``use_orig_params=True`` (Lightning's ``FSDPStrategy`` and Accelerate's default) each of the
model's parameters stays an ``nn.Parameter`` on its own module, but outside forward and backward it
holds this rank's piece of the parameter, flattened (empty on ranks that hold none of it), and its
``.grad`` that piece's gradient. gradwatch reads those pieces as it reads DTensor shards: their sums
of squares and non-finite counts are partial sums, their maxima partial maxima, combined over the
ranks at the flush with each distinct piece counted once.

With ``use_orig_params=False`` the model's parameters are gone from their modules: each unit has one
``FlatParameter``, whose ``.grad`` after backward is this rank's shard of the flattened gradients
of all the unit's parameters. gradwatch gives each original parameter a placeholder of its own (an
empty tensor, never part of the model) that knows where the parameter lies in the rank's shard
(:class:`FlatSlice`), and reads that slice of the flat gradient as the piece above.

What it needs from FSDP1 is private:

- ``FullyShardedDataParallel._handle.flat_param``: the unit's ``FlatParameter``, its ``_params``
  (the original parameters, with ``use_orig_params=True``), ``_shapes`` (their shapes),
  ``_param_infos`` (each one's module and name) and ``_shard_param_infos`` (where each lies in this
  rank's shard: ``in_shard``, ``offset_in_shard``, ``numel_in_shard``);
- ``_handle._use_orig_params`` and ``_handle.process_group`` (the group a unit is sharded over:
  the intra-node group under hybrid sharding).

Fallback: a torch where these are missing raises :class:`UnsupportedSharding` at attach (never a
silent per-shard value).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
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


@dataclass(frozen=True)
class FlatSlice:
    """Where one of the user's parameters lies in this rank's shard of its unit's ``FlatParameter``
    (FSDP1, ``use_orig_params=False``).

    Args:
        flat: the unit's ``FlatParameter`` (a weak reference: gradwatch keeps no model alive).
        offset: the parameter's first element in this rank's shard of the flat gradient.
        numel: how many of its elements this rank's shard holds (0: none).
    """

    flat: Any
    offset: int
    numel: int


#: The attribute of gradwatch's placeholder parameters that holds their :class:`FlatSlice`.
FLAT_SLICE = "_gradwatch_flat_slice"


@dataclass
class FlatUnits:
    """The parameters of FSDP1 units with ``use_orig_params=False``, as gradwatch reads them.

    Args:
        placeholders: id(module) -> [(parameter name, placeholder)], in the unit's order.
        sharded: id(placeholder) -> its whole shape and pieces.
        flat_ids: the ids of the ``FlatParameter`` s themselves (not layers of their own).
    """

    placeholders: dict[int, list[tuple[str, nn.Parameter]]]
    sharded: dict[int, ShardedParameter]
    flat_ids: set[int]


def _units(model: nn.Module) -> list[tuple[Any, bool, int, bool]]:
    """(handle, use_orig_params, group size, sharded strategy) of every FSDP1 unit with parameters."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    except ImportError:  # a build without distributed support
        return []
    found = []
    for unit in model.modules():
        if not isinstance(unit, FullyShardedDataParallel) or getattr(unit, "_handle", None) is None:
            continue  # not FSDP1, or a unit without parameters of its own
        handle = unit._handle
        try:
            found.append((handle, bool(handle._use_orig_params), int(handle.process_group.size()),
                          unit.sharding_strategy != ShardingStrategy.NO_SHARD))  # fmt: skip
        except AttributeError as exc:
            raise _unsupported(exc) from exc
    return found


def _unsupported(exc: BaseException) -> UnsupportedSharding:
    return UnsupportedSharding(
        f"gradwatch reads FSDP1's flat parameters through internals this torch does not have ({exc}); "
        "use FSDP2 (torch.distributed.fsdp.fully_shard), whose DTensor parameters gradwatch reduces to "
        "the whole layers"
    )


def sharded_parameters(model: nn.Module) -> dict[int, ShardedParameter]:
    """id(parameter) -> its whole shape and pieces, for every parameter FSDP1 shards in ``model`` with
    ``use_orig_params=True`` (empty without FSDP1; ``NO_SHARD`` units hold whole parameters and are
    left out; ``use_orig_params=False``: :func:`flat_units`).

    Raises:
        UnsupportedSharding: a torch whose FSDP1 internals are not the ones read here.
    """
    found: dict[int, ShardedParameter] = {}
    for handle, use_orig_params, group_size, sharded in _units(model):
        if not use_orig_params or not sharded:
            continue
        try:
            params, shapes = handle.flat_param._params, handle.flat_param._shapes
        except AttributeError as exc:
            raise _unsupported(exc) from exc
        for p, shape in zip(params, shapes):
            found[id(p)] = ShardedParameter(tuple(int(s) for s in shape), group_size)
    return found


def flat_units(model: nn.Module) -> FlatUnits:
    """A placeholder for each parameter of the FSDP1 units with ``use_orig_params=False`` in ``model``.

    Raises:
        UnsupportedSharding: a torch whose FSDP1 internals are not the ones read here.
    """
    units = FlatUnits({}, {}, set())
    for handle, use_orig_params, group_size, sharded in _units(model):
        if use_orig_params:
            continue
        flat = handle.flat_param
        units.flat_ids.add(id(flat))
        try:
            described = list(zip(flat._param_infos, flat._shapes, flat._shard_param_infos))
        except AttributeError as exc:
            raise _unsupported(exc) from exc
        for info, shape, where in described:
            placeholder = nn.Parameter(torch.empty(0, dtype=flat.dtype, device=flat.device))
            in_shard = bool(where.in_shard)
            setattr(placeholder, FLAT_SLICE, FlatSlice(weakref.ref(flat), int(where.offset_in_shard or 0) if in_shard else 0,
                                                       int(where.numel_in_shard or 0) if in_shard else 0))  # fmt: skip
            units.placeholders.setdefault(id(info.module), []).append((info.param_name, placeholder))
            units.sharded[id(placeholder)] = ShardedParameter(tuple(int(s) for s in shape), group_size if sharded else 0)
    return units


def flat_gradient(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's piece of a placeholder's parameter gradient: a slice of its unit's flat gradient
    (empty where the rank's shard holds none of it), or None (no flat gradient: before backward,
    after ``zero_grad``)."""
    where = getattr(p, FLAT_SLICE, None)
    flat = where.flat() if where is not None else None
    grad = flat.grad if flat is not None else None
    if grad is None:
        return None
    return grad.narrow(0, where.offset, where.numel)


def is_placeholder(p: torch.Tensor) -> bool:
    """A parameter gradwatch made for FSDP1's ``use_orig_params=False`` (not the model's)."""
    return hasattr(p, FLAT_SLICE)


def strip_wrapper_parts(qualified: str) -> str:
    """A qualified module name without the parts FSDP1 and checkpoint wrappers insert."""
    if not any(part in qualified for part in WRAPPER_PARTS):
        return qualified
    return ".".join(part for part in qualified.split(".") if part not in WRAPPER_PARTS)

