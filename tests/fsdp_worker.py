"""Worker for the FSDP2 test: runs in each of 2 processes (gloo, CPU)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def run(rank: int, world: int, port: int, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.fsdp import fully_shard

        from gradwatch import GradMonitor

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
        monitor = GradMonitor(model, flush_every=2)
        torch.manual_seed(100 + rank)  # each rank its own data
        expected = []
        for _ in range(2):
            model(torch.randn(4, 8)).square().mean().backward()
            monitor.step()
            full = {}
            for name in ("0", "2", "4"):
                grads = [p.grad.full_tensor().reshape(-1) for p in model.get_submodule(name).parameters()]
                full[name] = float(torch.linalg.vector_norm(torch.cat(grads)))
            local = {name: float(torch.linalg.vector_norm(torch.cat([p.grad.to_local().reshape(-1) for p in
                     model.get_submodule(name).parameters()]))) for name in ("0", "2", "4")}  # fmt: skip
            expected.append({"full": full, "local": local})
            model.zero_grad()
        w = monitor.last_window
        got = [{name: float(w.grad_norm[t, w.layers.index(name)]) for name in ("0", "2", "4")} for t in range(2)]
        monitor.close()
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump({"expected": expected, "got": got, "layers": w.layers}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port, out_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    run(rank, world, port, out_path)
