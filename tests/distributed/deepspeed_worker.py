"""DeepSpeed ZeRO worker (gloo, CPU; deepspeed's CPU accelerator): stages 1, 2 and 3 are refused at attach.

    gloo("tests.distributed.deepspeed_worker:body", 2)  (the gloo fixture: tests/conftest.py)

For each stage, the worker checks what makes ZeRO unreadable (after ``engine.backward`` every
``p.grad`` is None) and that ``GradMonitor`` refuses the engine and the module inside it.
"""

from __future__ import annotations

import os

import torch
from torch import nn


def body(rank: int, world: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; DeepSpeed asserts it
    import deepspeed

    from gradwatch import GradMonitor

    results = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        config = {"train_batch_size": 4 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}  # fmt: skip
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.backward(engine(torch.randn(4, 8)).square().mean())
        grads_none = all(p.grad is None for p in model.parameters())
        refused = []
        for target in (engine, model):
            try:
                GradMonitor(target).close()
                refused.append(None)
            except ValueError as exc:
                refused.append(f"{type(exc).__name__}: {exc}")
        engine.step()
        results[str(stage)] = {"grads_none": grads_none, "refused": refused}
    return results
