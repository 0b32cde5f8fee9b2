"""Host time of ``monitor.step()`` against depth, timed inside real training steps (#30).

    python benchmarks/step_host.py                  # 16, 64, 256 blocks
    python benchmarks/step_host.py --depths 16,64 --steps 150

Each depth trains two copies of the depth sweep's model (blocks of Linear + LayerNorm + ReLU,
width 256; ``workloads.deep_mlp``), interleaved step by step in one process: one monitored with the
default (``flush_every=50``), one unmonitored. Right after backward, where ``monitor.step()`` runs
and the GEMMs have just evicted the caches, the monitored copy times ``monitor.step()`` and the
unmonitored copy times the floor: the one read of every parameter gradient that the per-step
grad_norm needs (``torch._foreach_norm``, as ``clip_grad_norm_`` reads them). Only unsampled,
non-flush steps count (the step gradwatch takes ~47 times in 50). Reported per depth: medians in
microseconds, and gradwatch's host time above the floor per monitored layer; across depths, the
slope of that difference (what each extra layer costs beyond its read), which the target of #30
bounds at 5 us per layer.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads as W  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402


def measure_depth(depth: int, steps: int, batch: int, clock=time.perf_counter) -> dict:
    """Median host microseconds of ``monitor.step()`` and of the floor's gradient read at ``depth``
    blocks, over the unsampled, non-flush steps of ``steps`` interleaved training steps."""
    workload = W.deep_mlp(depth, batch=batch)
    torch.manual_seed(0)
    watched, plain = workload.make_model(), workload.make_model()
    plain.load_state_dict(watched.state_dict())
    x, y = workload.make_batch(torch.device("cpu"))
    monitor = GradMonitor(watched, flush_every=50)
    flags = monitor._recorder.flags
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (watched, plain)]
    params = [p for p in plain.parameters() if p.requires_grad]
    ours: list[float] = []
    floor: list[float] = []
    gc.disable()
    try:
        for step in range(steps):
            workload.loss(watched(x), y).backward()
            counted = not flags.sampling and (step + 1) % monitor.flush_every != 0 and step >= 10
            t0 = clock()
            monitor.step()
            if counted:
                ours.append(clock() - t0)
            workload.loss(plain(x), y).backward()
            t0 = clock()
            torch._foreach_norm([p.grad for p in params], 2)
            if counted:
                floor.append(clock() - t0)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        gc.enable()
        layers = len(monitor.layers)
        monitor.close()
    if not ours:
        raise RuntimeError(f"no unsampled, non-flush step among {steps} at depth {depth}: run more steps")
    step_us, floor_us = statistics.median(ours) * 1e6, statistics.median(floor) * 1e6
    return {"layers": layers, "counted_steps": len(ours), "step_us": step_us, "floor_us": floor_us,
            "above_floor_per_layer_us": (step_us - floor_us) / layers}  # fmt: skip


def slopes(figures: dict[int, dict]) -> dict[str, float]:
    """Per extra layer, the growth of gradwatch's host time above the floor between depths."""
    depths = sorted(figures)
    out = {}
    for a, b in zip(depths, depths[1:]):
        fa, fb = figures[a], figures[b]
        above = (fb["step_us"] - fb["floor_us"]) - (fa["step_us"] - fa["floor_us"])
        out[f"{a}->{b}"] = above / (fb["layers"] - fa["layers"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", default="16,64,256")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32, help="the host work does not depend on it")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    figures = {}
    print(f"{'blocks':>6} {'layers':>6} {'steps':>5} {'step() us':>10} {'floor us':>9} {'above/layer us':>15}")
    for depth in (int(d) for d in args.depths.split(",")):
        f = figures[depth] = measure_depth(depth, args.steps, args.batch)
        print(f"{depth:6d} {f['layers']:6d} {f['counted_steps']:5d} {f['step_us']:10.0f} {f['floor_us']:9.0f} "
              f"{f['above_floor_per_layer_us']:15.2f}")  # fmt: skip
    growth = slopes(figures)
    for span, value in growth.items():
        print(f"slope {span} blocks: {value:.2f} us per extra layer above the floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"depths": figures, "slopes": growth}, f, indent=1)


if __name__ == "__main__":
    main()
