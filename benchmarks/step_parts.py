"""Where an unsampled ``monitor.step()`` spends its host time, timed inside real training steps (#30).

    python benchmarks/step_parts.py                       # MLP 8x512
    python benchmarks/step_parts.py --workload transformer --steps 300

Right after backward, which has swept the caches, every distinct library path a call takes costs
tens of microseconds the first time (a numpy ufunc ~50 us, against ~2 us for the same call made
again; benchmarks/RESULTS.md, thirty-first session), so ``step()``'s cost is mostly how many
distinct calls it makes, not the work they do. Each part is timed by wrapping the object that owns
it (``harness.time_calls``, as ``flush_cost.py`` does), on the steps of each window that are neither sampled nor the flush,
after the first window. "read and settled" is the read of every gradient, which the read floor pays
too (one ``foreach_norm`` of the small tensors and a dot of each large float32 one:
``contenders.GradientRead``), with the squares' check; the rest is gradwatch's bookkeeping. Medians in microseconds; nested parts are indented.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import allocator_option, gradwatch_logger_at, time_calls, use_allocator  # noqa: E402
from gradwatch import GradMonitor  # noqa: E402
from gradwatch.capture import reductions  # noqa: E402
from gradwatch.capture.layout import planned_slots  # noqa: E402
from gradwatch.settings import DETAILS  # noqa: E402



def measure(workload, steps: int, flush_every: int = 50) -> dict[str, float]:
    """Median microseconds of each part of ``step()`` over the unsampled, non-flush steps after the first window."""
    torch.manual_seed(0)
    model = workload.make_model()
    x, y = workload.make_batch(torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    parts: dict[str, list[float]] = defaultdict(list)
    with tempfile.TemporaryDirectory() as logdir:
        monitor = GradMonitor(model, logdir=logdir, flush_every=flush_every)
        pipeline = monitor._stages.pipeline
        recorder = pipeline.recorder
        wrapped: list[tuple] = []
        for owner, attr, label in (
            (pipeline, "step", "pipeline.step"), (pipeline.watch.backward, "repeats_last_step", "  backward witnesses: read"),
            (recorder, "record_step", "  record_step"), (recorder.param_stats, "record", "    parameter gradients"),
            (recorder.param_stats._foreach, "reduce", "      read and settled"),
            (reductions, "foreach_norm", "        foreach_norm (small tensors)"),
            (reductions._CpuSlots, "settle", "        squares into the row, checked"),
            (pipeline.judge, "judge", "  per-step judgement (full)"),
            (pipeline.judge, "judge_calm", "  per-step judgement (calm case: from the host check)"),
            (pipeline.watch.backward, "remember", "  backward witnesses: remember"),
        ):  # fmt: skip
            wrapped.append(time_calls(owner, attr, label, parts, unit=1e6))
        sampled = planned_slots(flush_every, DETAILS["standard"])
        kept: dict[str, list[float]] = defaultdict(list)
        gc.disable()
        try:
            for step in range(steps):
                workload.loss(model(x), y).backward()
                before = {label: len(values) for label, values in parts.items()}
                monitor.step()
                slot = step % flush_every
                if step >= flush_every and not sampled[slot] and slot != flush_every - 1:
                    for label, values in parts.items():
                        kept[label] += values[before.get(label, 0):]
                opt.step()
                opt.zero_grad(set_to_none=True)
                if slot == 0:
                    gc.collect()
        finally:
            gc.enable()
            monitor.close()
            for owner, attr, inner in wrapped:
                setattr(owner, attr, inner)
    return {label: statistics.median(values) for label, values in kept.items() if values}  # (a part some steps skip)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(W.BY_NAME), default="mlp")
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300: five windows)")
    allocator_option(parser)
    args = parser.parse_args()
    print(f"# allocator {use_allocator(args.allocator)}")
    with gradwatch_logger_at(logging.ERROR):
        result = measure(W.BY_NAME[args.workload](), args.steps)
    order = ["pipeline.step", "  backward witnesses: read", "  record_step", "    parameter gradients",
             "      read and settled", "        foreach_norm (small tensors)", "        squares into the row, checked",
             "  per-step judgement (full)", "  per-step judgement (calm case: from the host check)",
             "  backward witnesses: remember"]  # fmt: skip
    for label in order:
        if label in result:
            print(f"{label:42s} {result[label]:8.1f} us")


if __name__ == "__main__":
    main()
