"""DeepSpeed ZeRO: recognised from the markers it puts on the model's parameters, without importing it.

ZeRO keeps gradients in its own partitioned buffers: after ``engine.backward`` every ``p.grad`` is
None (measured with deepspeed 0.19.8 on gloo, stages 1, 2 and 3). Markers (set by
``deepspeed.initialize``):

- stages 1 and 2: ``_hp_mapping`` (linked to the optimizer's fp32 partition; None on ranks whose
  partition holds none of the parameter) and ``_index_in_param_group``, ``_dp_group``. The
  parameters stay whole on every rank; each rank holds the reduced (averaged) gradient of its own
  partition from the end of ``engine.backward`` to ``engine.step()``, and
  ``_hp_mapping.get_lp_grad_fragment(index)`` (private) is this parameter's fragment of it: the
  pieces of the ranks are disjoint, so they are read like FSDP1 pieces (partial sums added up at
  the flush, each piece once), without a collective. DeepSpeed's public ``safe_get_full_grad``
  would all-reduce the whole gradient of every parameter at every step.
- stage 3: ``ds_id`` (every parameter a ``ZeroParameter``, partitioned itself): refused at attach.

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
    ZeRO stage 1 or 2 partitions (empty without ZeRO).

    Raises:
        UnsupportedSharding: ZeRO stage 3.
    """
    params = list(params)
    stage = zero_stage(params)
    if stage is None:
        return {}
    if stage == "3":
        raise UnsupportedSharding(refusal(stage))
    found = {}
    for p in params:
        if hasattr(p, "_hp_mapping"):
            group = getattr(p, "_dp_group", None)
            found[id(p)] = int(group.size()) if group is not None and hasattr(group, "size") else _world()
    return found


def local_gradient(p: torch.Tensor) -> torch.Tensor | None:
    """This rank's fragment of ``p``'s reduced gradient under ZeRO stage 1 or 2 (flat), or None: the
    rank holds none of it, or no gradient is there (before backward, after ``engine.step()``)."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        return mapping.get_lp_grad_fragment(p._index_in_param_group)
    except (ValueError, KeyError, IndexError):
        return None  # "Gradients are only available immediately after backward and before engine step"


def refusal(stage: str) -> str:
    """The message gradwatch refuses a ZeRO model it cannot read with."""
    return (
        f"this model is trained by DeepSpeed ZeRO (stage {stage}), which partitions the parameters "
        "themselves and keeps their gradients in its own buffers: gradwatch reads ZeRO stages 1 and 2, "
        "not stage 3. Train with ZeRO stage 1 or 2, DDP, FSDP1 (use_orig_params=True) or FSDP2 "
        "(fully_shard), or leave gradwatch off for this run"
    )


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
