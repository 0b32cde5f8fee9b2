"""An exception on one rank inside ``with GradMonitor(...)`` (gloo, CPU).

    gloo("tests.distributed.exception_worker:body", 2)  (the gloo fixture: tests/conftest.py)

Rank 0 raises inside its ``with`` block after two steps (no flush yet); rank 1 is still
training. Then both ranks make the user's own ``all_reduce`` of three floats: it must meet
the other rank's, not a reduction of gradwatch's buffer left by rank 0's close(). Rank 1
then closes its monitor with reduction off (its partner is gone), as a user's handler would.
"""

from __future__ import annotations

import torch
from torch import nn



def body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from gradwatch import GradMonitor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    collectives = None
    try:
        with GradMonitor(model, flush_every=50) as monitor:
            collectives = monitor._collectives
            for step in range(2):
                model(torch.randn(3, 4)).sum().backward()
                monitor.step()
                model.zero_grad()
            if rank == 0:
                raise RuntimeError("a failure in the user's code on rank 0")
            total = torch.ones(3)
            dist.all_reduce(total)  # the user's collective, with rank 0's below
            monitor.sync_dist = False  # rank 0 is gone: close without a collective
    except RuntimeError:
        total = torch.ones(3)
        dist.all_reduce(total)
    return {"user_sum": total.tolist(), "gradwatch_collectives": dict(collectives.calls)}

