"""What a flush costs the training thread, by part (#30: the default's cost over whole windows).

    python benchmarks/flush_cost.py                    # MLP 8x512 (9 layers), deep MLP 64 blocks (129 layers)
    python benchmarks/flush_cost.py --windows 10 --json out.json
    python benchmarks/flush_cost.py --workloads cnn,transformer

A flush runs on the training thread at every ``flush_every``-th ``step()``: it reads the window
(one device-to-host copy, the decode), runs the health checks, and writes TensorBoard's scalars
(a writer gradwatch owns, as with ``logdir=``). Its host time is paid once a window; on a fast
accelerator step (5 ms) a 10 ms flush is 4% of a 50-step window, and the device waits for it.
Each part is timed in real training steps by wrapping the object that owns it; medians over the
windows after the first (which imports and lays things out). Host work only: this does not
depend on the device beyond the read's copy. Last line: what the flush leaves to the writer's
thread, paid by the optimizer step after it (TensorBoard's record checksums: twenty-ninth session).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import allocator_option, gradwatch_logger_at, time_calls, use_allocator  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402
from gradwatch.capture.layout import planned_slots  # noqa: E402
from gradwatch.settings import DETAILS  # noqa: E402


#: Small batches: the flush's host work does not depend on the batch, only on layers and steps.
WORKLOADS = {
    "mlp": lambda: W.mlp(batch=32), "deep": lambda: W.deep_mlp(64, batch=32), "cnn": lambda: W.resnet(batch=4),
    "transformer": lambda: W.transformer(batch=2),
}


def measure(workload, windows: int, flush_every: int = 50, device: torch.device = torch.device("cpu")) -> dict:
    """Median milliseconds of a flush's parts, of the flush step's ``step()``, and of an unsampled
    step's ``step()``, over ``windows`` windows after the first."""
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    x, y = workload.make_batch(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    parts: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as logdir:
        monitor = GradMonitor(model, logdir=logdir, flush_every=flush_every, optimizer=opt)
        pipeline = monitor._stages.pipeline
        checks = pipeline.checks
        time_calls(pipeline, "flush", "whole flush", parts)
        time_calls(pipeline.reader, "read", "read (copy, reduce, decode)", parts)
        time_calls(pipeline.checks, "check", "health checks", parts)
        for rule, label in ((checks.exploding, "judge_window"), (checks.vanishing, "judge"),
                            (checks.update_ratio, "judge"), (checks.dead, "judge")):  # fmt: skip
            time_calls(rule, label, f"  {type(rule).__name__}", parts)
        time_calls(pipeline.outputs, "write", "write (TensorBoard)", parts)
        steps: list[tuple[int, float]] = []
        optimizer_steps: list[tuple[int, float]] = []
        for step in range((windows + 1) * flush_every):
            workload.loss(model(x), y).backward()
            start = time.perf_counter()
            monitor.step()
            middle = time.perf_counter()
            opt.step()
            opt.zero_grad()
            steps.append((step % flush_every, (middle - start) * 1e3))
            optimizer_steps.append((step % flush_every, (time.perf_counter() - middle) * 1e3))
        layers = len(monitor.layers)
        result = {label: statistics.median(values[1:]) for label, values in parts.items() if len(values) > 1}
        monitor.close()  # its last flush is not timed
    warm = steps[flush_every:]
    sampled = planned_slots(flush_every, DETAILS["standard"])  # the default's plan, not a copy of it
    result["flush step()"] = statistics.median(t for slot, t in warm if slot == flush_every - 1)
    result["unsampled step()"] = statistics.median(t for slot, t in warm
                                                   if not sampled[slot] and slot != flush_every - 1)  # fmt: skip
    # What the flush leaves running: the writer's thread (TensorBoard's checksums, in Python unless
    # gradwatch's writer does them in C: sinks/event_writer.py) holds the GIL while the training
    # thread runs the optimizer step that follows. Not part of the flush's own call above.
    warm_opt = optimizer_steps[flush_every:]
    result["optimizer step after it, extra"] = statistics.median(
        t for slot, t in warm_opt if slot == flush_every - 1) - statistics.median(
        t for slot, t in warm_opt if not sampled[slot] and slot != flush_every - 1)  # fmt: skip
    return {"layers": layers, "ms": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=8, help="windows timed after the first (default 8)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--workloads", default="mlp,deep",
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default mlp,deep)")
    allocator_option(parser)
    args = parser.parse_args()
    print(f"# allocator {use_allocator(args.allocator)}")
    report = {}
    with gradwatch_logger_at(logging.ERROR):
        for workload in (WORKLOADS[name]() for name in args.workloads.split(",")):
            figures = report[workload.name] = measure(workload, args.windows)
            print(f"\n# {workload.name}: {figures['layers']} layers, flush_every=50, median ms")
            for label, ms in figures["ms"].items():
                print(f"{label:32s} {ms:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
