"""Host time of ``monitor.step()`` against depth, timed inside real training steps (#30).

    python benchmarks/step_host.py                  # 16, 64, 256 blocks
    python benchmarks/step_host.py --depths 16,64 --steps 150

Each depth trains two copies of the depth sweep's model (blocks of Linear + LayerNorm + ReLU,
width 256; ``workloads.deep_mlp``), interleaved step by step in one process: one monitored with the
default (``flush_every=50``), one unmonitored. Right after backward, where ``monitor.step()`` runs
and the GEMMs have just evicted the caches, the monitored copy times ``monitor.step()`` and the
unmonitored copy times the floor: the one read of every parameter gradient that the per-step
grad_norm needs, the cheapest known way (``contenders.GradientRead``: one ``_foreach_norm`` as
``clip_grad_norm_`` reads them, and a dot of each float32 gradient of at least 64K elements). Only unsampled,
non-flush steps count (the step gradwatch takes ~47 times in 50). Reported per depth: medians in
microseconds, and gradwatch's host time above the floor per monitored layer; across depths, the
slope of that difference (what each extra layer costs beyond its read), which the target of #30
bounds at 5 us per layer.

    python benchmarks/step_host.py --compiled --depths 16,64 --steps 150

``--compiled``: both copies run through ``torch.compile`` (each its own entry list:
``contenders.compile_alone``), the unmonitored one with the compiled per-step floor's forward sums
(``contenders.DefaultStepFloor``, its sums fused into the model's kernels). Then the forward (the
compiled call and the loss) is timed too: in compiled code each monitored layer's tensors are graph
inputs that dynamo guards and AOTAutograd's wrapper handles at every call, host work that eager
taps pay in their hooks instead (benchmarks/RESULTS.md, thirty-fourth session).
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

from benchmarks import contenders as C  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import allocator_option, use_allocator  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402


def measure_depth(depth: int, steps: int, batch: int, clock=time.perf_counter, compiled: bool = False,
                  backend: str = "inductor") -> dict:  # fmt: skip
    """Median host microseconds of ``monitor.step()`` and of the floor's gradient read at ``depth``
    blocks, over the unsampled, non-flush steps of ``steps`` interleaved training steps; with
    ``compiled`` (``backend``: torch.compile's), also of the forward, gradwatch's and the compiled
    per-step floor's (see the module docstring)."""
    workload = W.deep_mlp(depth, batch=batch)
    torch.manual_seed(0)
    watched, plain = workload.make_model(), workload.make_model()
    plain.load_state_dict(watched.state_dict())
    x, y = workload.make_batch(torch.device("cpu"))
    monitor = GradMonitor(watched, flush_every=50)
    flags = monitor._recorder.flags
    optimizers = [torch.optim.SGD(m.parameters(), lr=1e-3) for m in (watched, plain)]
    params = [p for p in plain.parameters() if p.requires_grad]
    floor_sums = C.DefaultStepFloor(plain, workload, torch.device("cpu")) if compiled else None
    floor_read = C.GradientRead(params, cpu=True)
    runs = [C.compile_alone(m, backend=backend) if compiled else m for m in (watched, plain)]
    times: dict[str, list[float]] = {"step": [], "floor": [], "fwd": [], "floor_fwd": []}

    def timed(key: str, counted: bool, fn):  # noqa: ANN001, ANN202
        t0 = clock()
        result = fn()
        if counted:
            times[key].append(clock() - t0)
        return result

    gc.disable()
    try:
        for step in range(steps):
            counted = not flags.sampling and (step + 1) % monitor.flush_every != 0 and step >= 10
            timed("fwd", counted and compiled, lambda: workload.loss(runs[0](x), y)).backward()
            timed("step", counted, monitor.step)
            timed("floor_fwd", counted and compiled, lambda: workload.loss(runs[1](x), y)).backward()
            if floor_sums is not None:
                timed("floor", counted, floor_sums.after_backward)  # the gradient read; the sums let go
            else:
                timed("floor", counted, floor_read.read)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        gc.enable()
        layers = len(monitor.layers)
        monitor.close()
        if floor_sums is not None:
            floor_sums.close()
    if not times["step"]:
        raise RuntimeError(f"no unsampled, non-flush step among {steps} at depth {depth}: run more steps")
    us = {key: statistics.median(values) * 1e6 for key, values in times.items() if values}
    figures = {"layers": layers, "counted_steps": len(times["step"]), "step_us": us["step"], "floor_us": us["floor"],
               "above_floor_per_layer_us": (us["step"] - us["floor"]) / layers}  # fmt: skip
    if compiled:
        figures.update(fwd_us=us["fwd"], floor_fwd_us=us["floor_fwd"],
                       fwd_above_floor_per_layer_us=(us["fwd"] - us["floor_fwd"]) / layers)  # fmt: skip
    return figures


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
    parser.add_argument("--compiled", action="store_true", help="both copies compiled; the forward timed too")
    allocator_option(parser)
    args = parser.parse_args()
    print(f"# allocator {use_allocator(args.allocator)}")
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    figures = {}
    print(f"{'blocks':>6} {'layers':>6} {'steps':>5} {'step() us':>10} {'floor us':>9} {'above/layer us':>15}"
          + (f" {'forward us':>10} {'floor fwd us':>12} {'fwd above/layer':>15}" if args.compiled else ""))  # fmt: skip
    for depth in (int(d) for d in args.depths.split(",")):
        f = figures[depth] = measure_depth(depth, args.steps, args.batch, compiled=args.compiled)
        line = (f"{depth:6d} {f['layers']:6d} {f['counted_steps']:5d} {f['step_us']:10.0f} {f['floor_us']:9.0f} "
                f"{f['above_floor_per_layer_us']:15.2f}")  # fmt: skip
        if args.compiled:
            line += f" {f['fwd_us']:10.0f} {f['floor_fwd_us']:12.0f} {f['fwd_above_floor_per_layer_us']:15.2f}"
        print(line)
    growth = slopes(figures)
    for span, value in growth.items():
        print(f"slope {span} blocks: {value:.2f} us per extra layer above the floor")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"depths": figures, "slopes": growth}, f, indent=1)


if __name__ == "__main__":
    main()
