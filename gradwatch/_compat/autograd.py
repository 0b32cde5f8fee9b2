"""Where a forward call runs: inside backward (a recomputation), or inside reentrant checkpointing's
first forward. torch keeps no public flag for either."""

from __future__ import annotations

import sys

import torch

def in_backward() -> bool:
    """Whether this runs inside a backward pass: a forward recomputed there by reentrant activation
    checkpointing (whose first forward ran without grad) is not the forward order. False while
    dynamo traces (the recomputation is then inside a compiled graph, and the call is not
    traceable) and where the private API is missing."""
    if torch.compiler.is_compiling():
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() >= 0


_REENTRANT_DEPTH = 64  # frames searched for the reentrant checkpoint's forward


def in_reentrant_checkpoint() -> bool:
    """Whether this runs inside reentrant activation checkpointing's first forward (run without
    grad; the layers run again, with grad, inside backward). Found on the Python stack, as torch
    keeps no flag for it: only called for forward calls made without grad, on sampled steps.
    False while dynamo traces and where torch has no ``CheckpointFunction``."""
    if torch.compiler.is_compiling():
        return False
    function = getattr(getattr(torch.utils, "checkpoint", None), "CheckpointFunction", None)
    code = getattr(getattr(function, "forward", None), "__code__", None)
    frame = sys._getframe(1)
    for _ in range(_REENTRANT_DEPTH):
        if frame is None:
            return False
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def in_compiled_autograd() -> bool:
    """Whether this runs inside a backward that compiled autograd traces
    (``torch._dynamo.config.compiled_autograd``): a tensor hook is then traced into its graph, where
    ``torch.cond`` cannot be (torch 2.13). False where the private flag is missing."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    config = sys.modules.get("torch._dynamo.config")
    return bool(getattr(module, "in_compiled_autograd_region", False) or getattr(config, "compiled_autograd", False))


#: ``torch.cond`` traced inside a backward tensor hook, on a CPU predicate, as compiled taps use it:
#: measured on torch 2.13 only (earlier releases call cond a prototype "without training support");
#: elsewhere compiled taps compute the output-gradient statistics at every step and mask them.
COND_IN_HOOKS = torch.__version__ >= (2, 13)  # torch's TorchVersion: a 2.13 pre-release counts as older
