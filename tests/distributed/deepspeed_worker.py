"""DeepSpeed ZeRO worker (gloo, CPU; deepspeed's CPU accelerator).

    gloo("tests.distributed.deepspeed_worker:body", 2)  (the gloo fixture: tests/conftest.py)

Stages 1, 2 and 3: gradwatch's per-layer grad_norm and grad_max, against the whole (averaged)
gradient DeepSpeed assembles itself (``deepspeed.utils.safe_get_full_grad``, a collective per
parameter), read between ``engine.backward`` and ``engine.step``; every ``p.grad`` is None there
(what gradwatch cannot read); out_grad_norm against the root-sum-square over the ranks of the
output gradients the test retains itself. Layer "2" has 15 units (ZeRO 3 pads its last partition) and "scale"
a 1-D gain only (its units from its whole shape: under ZeRO 3 the parameter itself is empty).
ZeRO 3 before ``deepspeed.initialize`` (``deepspeed.zero.Init``): refused at attach.
"""

from __future__ import annotations

import collections
import os

import torch
from torch import nn

LAYERS = ("0", "2", "scale", "4")


class Gain(nn.Module):
    """A learned per-unit gain: its unit count is the length of its 1-D weight."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers = [("0", nn.Linear(8, 16)), ("1", nn.ReLU()), ("2", nn.Linear(16, 15)), ("scale", Gain(15)),
              ("3", nn.ReLU()), ("4", nn.Linear(15, 3))]  # fmt: skip
    return nn.Sequential(collections.OrderedDict(layers))


def _engine(stage: int, world: int):
    import deepspeed

    model = _model()
    config = {"train_batch_size": 4 * world, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}  # fmt: skip
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine, model


def body(rank: int, world: int) -> dict:
    from ..dist_helpers import deepspeed_on_cpu

    os.environ.setdefault("LOCAL_RANK", str(rank))  # what a launcher sets; DeepSpeed asserts it
    deepspeed_on_cpu()
    from deepspeed.utils import safe_get_full_grad

    from gradwatch import GradMonitor
    from gradwatch._compat.deepspeed import local_gradient

    from ..reference import RetainedOutputs

    results = {}
    for stage in (1, 2, 3):
        engine, model = _engine(stage, world)
        monitor = GradMonitor(model, flush_every=4, detail="full")
        capture = RetainedOutputs(model, list(LAYERS))
        steps = []
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(x).square().mean())
            grads_none = all(p.grad is None for p in model.parameters())
            held = sum(g.numel() for g in map(local_gradient, model.parameters()) if g is not None)
            monitor.step()
            whole = {name: torch.cat([safe_get_full_grad(p).reshape(-1).double()
                                      for p in model.get_submodule(name).parameters()]) for name in LAYERS}  # fmt: skip
            # out_grad_norm: the root-sum-square over both ranks of this rank's output gradients
            out_sq = torch.tensor([capture.norm(n) ** 2 for n in LAYERS], dtype=torch.float64)
            torch.distributed.all_reduce(out_sq)
            capture.clear()
            expected = {n: {"grad_norm": float(g.norm()), "grad_max": float(g.abs().max()),
                            "out_grad_norm": float(out_sq[i].sqrt())} for i, (n, g) in enumerate(whole.items())}  # fmt: skip
            total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO 3: the whole size
            steps.append({"grads_none": grads_none, "held": held, "total": total, "expected": expected})
            engine.step()
        capture.remove()
        calls_before_flush = dict(monitor._collectives.calls)
        monitor.close()
        w = monitor.last_window
        for t, record in enumerate(steps):
            record["got"] = {n: {s: float(getattr(w, s)[t, w.layers.index(n)]) for s in record["expected"][n]}
                             for n in LAYERS}  # fmt: skip
        results[str(stage)] = {"steps": steps, "layers": w.layers, "calls_before_flush": calls_before_flush,
                               "calls": dict(monitor._collectives.calls), "alerts": [a.kind for a in monitor.alerts],
                               "units": dict(zip(w.layers, map(int, w.unit_counts))),
                               "histograms": _histograms(engine, model, rank)}  # fmt: skip
    results["before_initialize"] = _refused_before_initialize(world)
    return results


def _histograms(engine, model: nn.Module, rank: int) -> dict | None:
    """``histograms=True`` at a flush between ``engine.backward`` and ``engine.step`` (flush_every=1):
    rank 0's histogram of each layer against the fragments of ZeRO's gradient it holds itself
    (``local_gradient``, read by the test): {layer: ((count, min, max) written, (the same) expected)},
    None for a layer of which the rank holds nothing."""
    import tempfile

    from gradwatch import GradMonitor
    from gradwatch._compat.deepspeed import local_gradient

    from ..reference import histograms_against

    logdir = tempfile.mkdtemp() if rank == 0 else None
    monitor = GradMonitor(model, flush_every=1, histograms=True, logdir=logdir)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7 + rank))
    engine.backward(engine(x).square().mean())
    monitor.step()  # the flush: histograms of what this rank holds now
    # copies (views of ZeRO's buffers, which engine.step reuses); a layer none of whose gradient
    # lies in this rank's partitions has no histogram here
    held = {n: [g.clone() for g in map(local_gradient, model.get_submodule(n).parameters()) if g is not None and g.numel()]
            for n in LAYERS}  # fmt: skip
    engine.step()
    monitor.close()
    return None if logdir is None else histograms_against(logdir, held)


def _refused_before_initialize(world: int) -> str | None:
    """ZeRO 3's partitioned parameters before any optimizer holds them: no gradient to read."""
    import deepspeed

    from gradwatch import GradMonitor

    config = {"train_batch_size": 4 * world, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _model()
    try:
        GradMonitor(model).close()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None
