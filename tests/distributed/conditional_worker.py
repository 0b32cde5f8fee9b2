"""Conditional compute across ranks (gloo, CPU): layers called in different orders, one on rank 0 only.

    gloo("tests.distributed.conditional_worker:body", 2[, "ok"|"subset"|"mismatch"|"fail"|"collective"])  (the gloo fixture: tests/conftest.py)

Rank 0 calls ``a`` before ``b`` and runs ``expert``; rank 1 calls ``b`` before ``a``
and never runs ``expert`` (a mixture-of-experts route, a branch taken by some
batches). ``gate`` is an identity layer before a ReLU, fed inputs whose first
units are negative (4 of them on rank 0, 2 on rank 1): those units get a zero
output gradient on that rank. Each rank records, with its own tensor hooks, the
squared norm of every output gradient per step and which units ever had a
non-zero gradient per window, next to what gradwatch reports after each flush.

Modes: ``subset`` monitors ``expert`` on rank 0 only (include/exclude differ: the ranks agree
on the union of their layers), and turns reduction off after the first window; ``mismatch`` gives rank 1 an ``expert`` of another width (the
same name for a different layer: statistics cannot be combined); ``fail`` makes recording
raise on rank 1 at step 4; ``collective`` makes the first collective of the first flush raise on
every rank.
"""

from __future__ import annotations

import logging

import torch
from torch import nn


LAYERS = ("gate", "a", "b", "expert", "head")
FLUSH_EVERY = 3
STEPS = 6


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 8)
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(8, 6)
        self.expert = nn.Linear(8, 6)
        self.head = nn.Linear(6, 1)
        with torch.no_grad():
            self.gate.weight.copy_(torch.eye(8))
            self.gate.bias.zero_()

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.relu(self.gate(x))
        if rank == 0:
            y = self.a(h) + self.b(h)
            y = y + self.expert(h)
        else:
            yb = self.b(h)
            y = yb + self.a(h)
        return self.head(torch.tanh(y))


def body(rank: int, world: int, mode: str = "ok") -> dict:
    from gradwatch import GradMonitor

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("gradwatch").addHandler(Collect())
    torch.manual_seed(0)
    model = Routed()
    if mode == "mismatch" and rank == 1:
        model.expert = nn.Linear(8, 5)  # never run on rank 1
    exclude = "expert" if mode == "subset" and rank == 1 else None
    monitor = GradMonitor(model, flush_every=FLUSH_EVERY, exclude=exclude, detail="full")
    if mode == "fail" and rank == 1:
        record, calls = monitor._recorder.param_stats.record, [0]

        def failing(rows, present):
            calls[0] += 1
            if calls[0] == 5:
                raise RuntimeError("forced failure on rank 1")
            return record(rows, present)

        monitor._recorder.param_stats.record = failing
    collective_calls = [0]
    if mode == "collective":  # the first collective of the first flush raises on every rank (a broken communicator)
        import torch.distributed as dist

        all_reduce = dist.all_reduce

        def failing_collective(*args, **kwargs):
            collective_calls[0] += 1
            if collective_calls[0] == 1:
                raise RuntimeError(f"forced collective failure on rank {rank}")
            return all_reduce(*args, **kwargs)

        dist.all_reduce = failing_collective
    retained: dict[str, list[torch.Tensor]] = {name: [] for name in LAYERS}

    def keep(name):
        def hook(module, args, out):
            if torch.is_grad_enabled():
                out.retain_grad()
                retained[name].append(out)

        return hook

    for name in LAYERS:
        model.get_submodule(name).register_forward_hook(keep(name))
    torch.manual_seed(100 + rank)
    negative = 4 if rank == 0 else 2
    steps, windows = [], []
    alive = {name: None for name in LAYERS}
    for step in range(STEPS):
        for _ in range(2):  # two micro-batches per step
            x = torch.rand(5, 8) + 0.1
            x[:, :negative] *= -1
            model(x, rank).square().mean().backward()
        sq = {}
        for name in LAYERS:
            outs = retained[name]
            sq[name] = sum(float(o.grad.double().square().sum()) for o in outs)
            if outs:
                mask = torch.stack([(o.grad != 0).reshape(-1, o.shape[-1]).any(0) for o in outs]).any(0)
                alive[name] = mask if alive[name] is None else alive[name] | mask
            outs.clear()
        steps.append(sq)
        alerts = monitor.step()
        model.zero_grad()
        if (step + 1) % FLUSH_EVERY == 0:
            w = monitor.last_window
            if w is None or w.steps[-1] != step:
                windows.append(None)  # this flush's window was dropped
                continue
            windows.append({
                "steps": w.steps,
                "out_grad_norm": {n: [float(v) for v in w.out_grad_norm[:, i]] for i, n in enumerate(w.layers)},
                "grad_norm": {n: [float(v) for v in w.grad_norm[:, i]] for i, n in enumerate(w.layers)},
                "dead_fraction": {n: float(w.dead_fraction[i]) for i, n in enumerate(w.layers)},
                "alive": {n: (None if alive[n] is None else alive[n].tolist()) for n in LAYERS},
                "alerts": [a.kind for a in alerts],
            })  # fmt: skip
            alive = {name: None for name in LAYERS}
            if mode == "subset":
                monitor.sync_dist = False  # the second window: each rank its own, in the union's layout
    sync = monitor.sync_dist
    monitor.close()
    if mode == "collective":
        dist.all_reduce = all_reduce
        dist.barrier()  # both ranks got here: nobody waited forever
    return {"steps": steps, "windows": windows, "sync_dist": sync, "warnings": warnings,
            "collective_calls": collective_calls[0]}

