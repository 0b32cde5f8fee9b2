"""DeepSpeed ZeRO worker (gloo, CPU; deepspeed's CPU accelerator).

    gloo("tests.distributed.deepspeed_worker:body", 2)  (the gloo fixture: tests/conftest.py)

Stages 1 and 2: gradwatch's per-layer grad_norm and grad_max, against the whole (averaged)
gradient DeepSpeed assembles itself (``deepspeed.utils.safe_get_full_grad``, an all-reduce per
parameter), read between ``engine.backward`` and ``engine.step``; every ``p.grad`` is None there
(what gradwatch cannot read). Stage 3: refused at attach, the engine and the module inside it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

LAYERS = ("0", "2", "4")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def _engine(stage: int, world: int):
    import deepspeed

    model = _model()
    config = {"train_batch_size": 4 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def body(rank: int, world: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; DeepSpeed asserts it
    from deepspeed.utils import safe_get_full_grad

    from gradwatch import GradMonitor
    from gradwatch._compat.deepspeed import local_gradient

    results = {}
    for stage in (1, 2):
        engine, model = _engine(stage, world)
        monitor = GradMonitor(model, flush_every=4, detail="full")
        steps = []
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(x).square().mean())
            grads_none = all(p.grad is None for p in model.parameters())
            held = sum(g.numel() for g in map(local_gradient, model.parameters()) if g is not None)
            monitor.step()
            whole = {name: torch.cat([safe_get_full_grad(p).reshape(-1).double()
                                      for p in model.get_submodule(name).parameters()]) for name in LAYERS}  # fmt: skip
            steps.append({"grads_none": grads_none, "held": held, "total": sum(p.numel() for p in model.parameters()),
                          "expected": {n: {"grad_norm": float(g.norm()), "grad_max": float(g.abs().max())}
                                       for n, g in whole.items()}})  # fmt: skip
            engine.step()
        calls_before_flush = dict(monitor._collectives.calls)
        monitor.close()
        w = monitor.last_window
        for t, record in enumerate(steps):
            record["got"] = {n: {s: float(getattr(w, s)[t, w.layers.index(n)]) for s in ("grad_norm", "grad_max")}
                             for n in LAYERS}  # fmt: skip
        results[str(stage)] = {"steps": steps, "layers": w.layers, "calls_before_flush": calls_before_flush,
                               "calls": dict(monitor._collectives.calls), "alerts": [a.kind for a in monitor.alerts]}  # fmt: skip
    engine, model = _engine(3, world)
    refused = []
    for target in (engine, model):
        try:
            GradMonitor(target).close()
            refused.append(None)
        except ValueError as exc:
            refused.append(f"{type(exc).__name__}: {exc}")
    results["3"] = {"refused": refused}
    return results
