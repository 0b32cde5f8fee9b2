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


#: Compiled taps' opaque ops (``capture/host_branch.py``: custom ops called from forward
#: and backward hooks, inside compiled autograd's graph too): measured on torch 2.13 only; elsewhere
#: compiled taps compute their sampled statistics at every step and mask them.
OPS_IN_HOOKS = torch.__version__ >= (2, 13)  # torch's TorchVersion: a 2.13 pre-release counts as older
