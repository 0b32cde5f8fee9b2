"""Every private or unstable torch API gradwatch reads, one module per concern, each with its
fallback: ``dynamo`` (compiled code and gradwatch's hooks, the user's names), ``amp`` (GradScaler
state without a sync), ``autograd`` (where a forward call runs), ``parallel`` (tensor parallelism
and FSDP2 layouts), ``fsdp1`` (the user's parameters inside FSDP1's flat shards), ``deepspeed`` (ZeRO 1, 2 and 3: each rank's fragment of the reduced gradient), ``inductor`` (the
opaque ops called as Python functions by inductor's generated code). Elsewhere gradwatch uses only what torch's own utilities use the same way
(``torch._foreach_*`` kernels as in ``clip_grad``, ``torch._C._set_grad_enabled``) and tensors'
version counters (``capture/freshness.py``)."""

from . import deepspeed, fsdp1, inductor, parallel
from .amp import scaler_scale, scaler_unscaled
from .autograd import OPS_IN_HOOKS, in_backward, in_reentrant_checkpoint
from .dynamo import (
    at_recompile_limit, forget_compiled_frames, guard_on_hooks, is_compiled_wrapper, model_code, release_hook_guards,
    unwrap, user_name,
)  # fmt: skip

__all__ = [
    "OPS_IN_HOOKS", "deepspeed", "fsdp1", "inductor", "parallel", "scaler_scale", "scaler_unscaled", "in_backward", "in_reentrant_checkpoint",
    "at_recompile_limit", "forget_compiled_frames", "guard_on_hooks", "model_code", "is_compiled_wrapper",
    "release_hook_guards", "unwrap", "user_name",
]
