"""Dead units confirmed inside their own window across data-parallel ranks (gloo, CPU, DDP).

    gloo("tests.distributed.dead_units_worker:body", 2, "agree"|"disagree")  (the gloo fixture: tests/conftest.py)
    gloo("tests.distributed.dead_units_worker:crossed", 2)

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
    windows, fired, norms = [], torch.zeros(64), []
    for step in range(STEPS):
        x = torch.randn(32, 16, generator=batches)
        if mode == "disagree" and rank == 1 and step < 2:
            x = x * 1000.0
        with torch.no_grad():
            fired += (model[0](x) > 0).any(0).float()  # a ReLU unit passes gradient where it fires
        ddp(x).sum().backward()
        # the test's own per-layer norms of DDP's averaged gradients (the same on every rank)
        norms.append({name: float(sum(p.grad.double().square().sum() for p in model.get_submodule(name).parameters()))
                      ** 0.5 for name in ("0", "2")})  # fmt: skip
        monitor.step()
        opt.step()
        opt.zero_grad()
        if step % FLUSH_EVERY == FLUSH_EVERY - 1:
            dist.all_reduce(fired)  # the test's own count over every rank's rows
            w = monitor.last_window
            layer = w.layers.index("0")
            windows.append({"sampled": w.sampled.tolist(), "dead_fraction": float(w.dead_fraction[layer]),
                            "own_dead_fraction": float((fired == 0).float().mean()),
                            "out_grad_norm": [None if v != v else float(v) for v in w.out_grad_norm[:, layer]],
                            "grad_norm": {name: [float(v) for v in w.grad_norm[:, w.layers.index(name)]] for name in ("0", "2")},
                            "own_grad_norm": norms[-FLUSH_EVERY:]})  # fmt: skip
            fired.zero_()
    per_step_rows = monitor._recorder.per_step_rows is not None
    monitor.close()
    return {"alerts": [[a.kind, a.layer, a.step, a.value] for a in monitor.alerts], "windows": windows,
            "per_step_rows": per_step_rows}


class _TwoGates(nn.Module):
    """Two gated branches, each with 48 of its 64 ReLU units behind a bias of -100."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(16, 64)
        self.head = nn.Linear(128, 1)
        with torch.no_grad():
            for gate in (self.a, self.b):
                gate.bias[:48] = -100.0
                gate.bias[48:] = 1.0

    def forward(self, xa: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([torch.relu(self.a(xa)), torch.relu(self.b(xb))], dim=1))


def crossed(rank: int, world: int) -> dict:
    """Each rank finds a different gate dead on its first sampled steps (the other rank's first two
    batches for that gate are scaled by 1000, so its units fire there): both ranks record the rest
    of the window in full, each for its own reason, and the reduced window finds both gates alive.
    Returns each rank's rule state after every window (it must be the same on both ranks)."""
    from gradwatch import GradMonitor

    torch.manual_seed(0)
    model = _TwoGates()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    monitor = GradMonitor(model, flush_every=FLUSH_EVERY, optimizer=opt)
    batches = torch.Generator().manual_seed(rank + 1)
    states, sampled = [], []
    for step in range(STEPS):
        xa, xb = torch.randn(32, 16, generator=batches), torch.randn(32, 16, generator=batches)
        if step < 2:  # rank 0 sees gate b fire, rank 1 gate a
            xa, xb = (xa, xb * 1000.0) if rank == 0 else (xa * 1000.0, xb)
        ddp(xa, xb).sum().backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
        if step % FLUSH_EVERY == FLUSH_EVERY - 1:
            states.append(monitor.state_dict()["checks"])
            sampled.append(monitor.last_window.sampled.tolist())
    monitor.close()
    return {"states": states, "sampled": sampled, "alerts": [[a.kind, a.layer, a.step] for a in monitor.alerts]}
