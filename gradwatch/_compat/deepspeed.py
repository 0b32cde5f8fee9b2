"""DeepSpeed ZeRO: recognised from the markers it puts on the model's parameters, without importing it.

ZeRO keeps gradients in its own partitioned buffers: after ``engine.backward`` every ``p.grad`` is
None (measured with deepspeed 0.19.8 on gloo, stages 1, 2 and 3). Each rank holds the reduced
(averaged) gradient of its own partition from the end of ``engine.backward`` to ``engine.step()``;
the pieces of the ranks are disjoint, so they are read like FSDP1 pieces (partial sums added up at
the flush, each piece once), without a collective. DeepSpeed's public ``safe_get_full_grad`` would
all-gather or all-reduce the whole gradient of every parameter at every step. Markers (set by
``deepspeed.initialize``):

- stages 1 and 2: ``_hp_mapping`` (linked to the optimizer's fp32 partition; None on ranks whose
  partition holds none of the parameter) and ``_index_in_param_group``, ``_dp_group``. The
  parameters stay whole on every rank; ``_hp_mapping.get_lp_grad_fragment(index)`` (private) is
  this parameter's fragment of the reduced gradient.
- stage 3: ``ds_id``: every parameter a ``ZeroParameter``, partitioned itself (``p`` is empty
  outside forward and backward; ``ds_shape`` is its whole shape) over ``ds_process_group``.
  ``_z3_optimizer`` (set when ``deepspeed.initialize`` builds the ZeRO-3 optimizer) reads this
  rank's partition of the parameter's gradient: ``get_local_fp32_grad_for_param``, what DeepSpeed's
  public ``safe_get_local_grad`` calls (a view of ZeRO's gradient buffer; the padding of the last
  partition is zero). On an accelerator it first synchronises ZeRO's reduce stream, which the end of
  ``engine.backward`` has already synchronised. With the optimizer's states swapped to NVMe reading a
  gradient would swap them in and out: not read (no gradient recorded for those parameters).

Fallback: a DeepSpeed whose fragments cannot be read that way records no gradient for those
parameters (one WARNING at ``step()``: no parameter had a .grad); one that sets none of these
markers is not recognised.
"""

from __future__ import annotations

from typing import Iterable

import torch

from .fsdp1 import UnsupportedSharding


def zero_stage(params: Iterable[torch.Tensor]) -> str | None:
    """"3", "1 or 2", or None (not under ZeRO, as far as the parameters say)."""
    stage = None
    for p in params:
        if hasattr(p, "ds_id"):
            return "3"
        if hasattr(p, "_hp_mapping"):
            stage = "1 or 2"
    return stage


def partitioned_gradients(params: Iterable[torch.Tensor]) -> dict[int, int]:
    """id(parameter) -> the number of ranks its gradient is partitioned over, for the parameters
    ZeRO partitions (empty without ZeRO).

    Raises:
        UnsupportedSharding: ZeRO stage 3 parameters with no ZeRO-3 optimizer linked to them (the
            monitor was created before ``deepspeed.initialize``, or the engine trains nothing).
    """
    params = list(params)
    stage = zero_stage(params)
    if stage is None:
        return {}
    found = {}
    for p in params:
        if hasattr(p, "ds_id"):
            if getattr(p, "_z3_optimizer", None) is None:
                raise UnsupportedSharding(not_initialised())
            found[id(p)] = _size(getattr(p, "ds_process_group", None))
        elif hasattr(p, "_hp_mapping"):
            found[id(p)] = _size(getattr(p, "_dp_group", None))
    return found


def whole_shape(p: torch.Tensor) -> tuple[int, ...] | None:
    """The whole shape of a ZeRO-3 parameter (``p`` itself is an empty placeholder); None otherwise."""
    shape = getattr(p, "ds_shape", None) if hasattr(p, "ds_id") else None
    return None if shape is None else tuple(int(s) for s in shape)


def local_gradient(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of ``p``'s reduced gradient under ZeRO (flat), or None: the rank holds
    none of it, or no gradient is there (before backward, after ``engine.step()`` for stages 1/2)."""
    if hasattr(p, "ds_id"):
        return _stage3_partition(p)
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        return mapping.get_lp_grad_fragment(p._index_in_param_group)
    except (ValueError, KeyError, IndexError):
        return None  # "Gradients are only available immediately after backward and before engine step"


def _stage3_partition(p: torch.Tensor) -> torch.Tensor | None:
    optimizer = getattr(p, "_z3_optimizer", None)
    if optimizer is None or not p.requires_grad or getattr(optimizer, "swap_optimizer", False):
        return None
    try:
        return optimizer.get_local_fp32_grad_for_param(p)
    except (AttributeError, KeyError, IndexError, RuntimeError):
        return None


def not_initialised() -> str:
    """The message gradwatch refuses ZeRO-3 parameters without their optimizer with."""
    return (
        "this model's parameters are partitioned by DeepSpeed ZeRO stage 3, but no ZeRO-3 optimizer "
        "holds them yet, so there is no gradient to read: create the monitor after "
        "deepspeed.initialize(model=..., config=...) with an optimizer (GradMonitor(engine) or "
        "GradMonitor(engine.module)), or leave gradwatch off for this run"
    )


def _size(group: object) -> int:
    if group is not None and hasattr(group, "size"):
        return int(group.size())
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    return 1
