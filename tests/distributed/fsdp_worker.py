"""FSDP2 worker (gloo, CPU): 2 processes with one shard dim, or 4 on a 2x2 replicate x shard mesh.

    gloo("tests.distributed.fsdp_worker:body", WORLD, "flat"|"hsdp")  (the gloo fixture: tests/conftest.py)

Each rank trains on its own data and records, per step and layer, the norm of the
full gradient (``p.grad.full_tensor()``) and of its local shard next to gradwatch's
grad_norm.
"""

from __future__ import annotations


import torch
from torch import nn


LAYERS = ("0", "2", "4")


def body(rank: int, world: int, mode: str = "flat") -> dict:
    from torch.distributed.fsdp import fully_shard

    from gradwatch import GradMonitor

    mesh = None
    if mode == "hsdp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    for name in LAYERS:
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    monitor = GradMonitor(model, flush_every=4, optimizer=opt)
    torch.manual_seed(100 + rank)  # each rank its own data

    def full_weights(name):
        return torch.cat([p.full_tensor().reshape(-1).double() for p in model.get_submodule(name).parameters()])

    expected = []
    for _ in range(2):
        model(torch.randn(4, 8)).square().mean().backward()
        monitor.step()
        full, local, ratio = {}, {}, {}
        for name in LAYERS:
            params = list(model.get_submodule(name).parameters())
            full[name] = float(torch.linalg.vector_norm(torch.cat([p.grad.full_tensor().reshape(-1) for p in params])))
            local[name] = float(torch.linalg.vector_norm(torch.cat([p.grad.to_local().reshape(-1) for p in params])))
        before = {name: full_weights(name) for name in LAYERS}
        opt.step()
        for name in LAYERS:
            ratio[name] = float((full_weights(name) - before[name]).norm() / before[name].norm())
        expected.append({"full": full, "local": local, "update_ratio": ratio})
        opt.zero_grad()
    monitor.close()  # flushes both steps and both update measurements
    w = monitor.last_window
    got = [{name: float(w.grad_norm[t, w.layers.index(name)]) for name in LAYERS} for t in range(2)]
    got_ratio = [{name: float(w.update_ratio[t, w.layers.index(name)]) for name in LAYERS} for t in range(2)]
    placements = [str(p.placements) for p in model.parameters()]
    return {"expected": expected, "got": got, "got_ratio": got_ratio, "update_steps": w.update_steps,
            "layers": w.layers, "placements": placements}  # fmt: skip

