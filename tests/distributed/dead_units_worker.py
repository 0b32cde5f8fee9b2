"""Dead units confirmed inside their own window across data-parallel ranks (gloo, CPU, DDP).

    gloo("tests.distributed.dead_units_worker:body", 2, "agree"|"disagree")  (the gloo fixture: tests/conftest.py)

Layer ``0`` (16 -> 64, then a ReLU) has 48 of its 64 units dead (bias -100) and the others firing on
most rows (bias 1); windows of 25 steps, 32 rows per rank, 50 steps, no learning (lr 0). "agree":
every rank sees the dead units on the window's first sampled steps, so each switches to recording
every step from the same step on. "disagree": rank 1's first two batches are scaled by 1000, so
the dead units fire there: rank 0 switches alone. Each rank also counts, with its own hooks, the
units of layer ``0`` that passed a gradient on any row of any rank in each window.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

FLUSH_EVERY = 25
STEPS = 50


def body(rank: int, world: int, mode: str) -> dict:
    from gradwatch import GradMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].bias[:48] = -100.0
        model[0].bias[48:] = 1.0
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradMonitor(model, flush_every=FLUSH_EVERY, optimizer=opt)
    batches = torch.Generator().manual_seed(rank + 1)
    windows, fired = [], torch.zeros(64)
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=batches)
        if mode == "disagree" and rank == 1 and step < 2:
            x = x * 1000.0
        with torch.no_grad():
            fired += (model[0](x) > 0).any(0).float()  # a ReLU unit passes gradient where it fires
        ddp(x).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
        if step % FLUSH_EVERY == FLUSH_EVERY - 1:
            dist.all_reduce(fired)  # the test's own count over every rank's rows
            w = monitor.last_window
            layer = w.layers.index("0")
            windows.append({"sampled": w.sampled.tolist(), "dead_fraction": float(w.dead_fraction[layer]),
                            "own_dead_fraction": float((fired == 0).float().mean()),
                            "out_grad_norm": [None if v != v else float(v) for v in w.out_grad_norm[:, layer]]})  # fmt: skip
            fired.zero_()
    monitor.close()
    return {"alerts": [[a.kind, a.layer, a.step, a.value] for a in monitor.alerts], "windows": windows}
