"""DeepSpeed ZeRO: recognised from the markers it puts on the model's parameters, without importing it.

ZeRO keeps gradients in its own partitioned buffers: after ``engine.backward`` every ``p.grad`` is
None (measured with deepspeed 0.19.8 on gloo, stages 1, 2 and 3), so there is nothing for
gradwatch to read at ``step()``; its public ``safe_get_full_grad`` makes a collective per
parameter, which gradwatch does not make at every step. So a model under ZeRO is refused at
attach, naming the stage and what to use. Markers (set by ``deepspeed.initialize``):

- stage 3: ``ds_id`` (every parameter is a ``ZeroParameter``);
- stages 1 and 2: ``_hp_mapping`` / ``get_full_hp_grad`` (linked to the optimizer's fp32 partitions).

Fallback: a DeepSpeed that sets neither is not recognised; gradwatch then says at the first
``step()`` that no parameter had a gradient (one WARNING), as before.
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
        if hasattr(p, "_hp_mapping") or hasattr(p, "get_full_hp_grad"):
            stage = "1 or 2"
    return stage


def refuse_zero(params: Iterable[torch.Tensor]) -> None:
    """Raise :class:`UnsupportedSharding` when ``params`` are under DeepSpeed ZeRO (see the module)."""
    stage = zero_stage(params)
    if stage is not None:
        raise UnsupportedSharding(refusal(stage))


def refusal(stage: str) -> str:
    """The message gradwatch refuses a ZeRO model with."""
    return (
        f"this model is trained by DeepSpeed ZeRO (stage {stage}), which keeps gradients in its own "
        "partitioned buffers: p.grad is None when gradwatch reads it, and the whole gradient costs a "
        "collective per parameter. gradwatch does not support ZeRO yet: train with DDP (DeepSpeed's "
        '"zero_optimization": {"stage": 0} keeps p.grad), FSDP1 (use_orig_params=True) or FSDP2 '
        "(fully_shard), or leave gradwatch off for this run"
    )
