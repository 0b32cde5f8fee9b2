"""``monitor.step()`` of the working tree against another revision's, in one process (#30).

    python benchmarks/step_ab.py --rev 723e2d0                    # eager MLP 8x512, 400 steps
    python benchmarks/step_ab.py --rev HEAD --workload cnn --steps 200

Changes of tens of microseconds to ``step()`` are below what whole windows resolve from one
process to the next (their A/A reads up to a point, ~0.3 ms of the MLP's step). Here three copies
of one model train interleaved, in rotating orders: one monitored by the working tree's gradwatch,
one by revision ``--rev``'s (``git archive`` of its ``gradwatch/`` into a temporary folder, imported
as ``gradwatch_old``), and one unmonitored that reads every gradient once as the per-step floor does
(``contenders.GradientRead``: one ``_foreach_norm``, and a dot of each large float32 gradient). Right after each backward the copy's ``step()`` (or
the floor's read) is timed; reported are medians over the unsampled, non-flush steps, and the
median of the paired differences between the two revisions' ``step()`` at the same step, with
the same for the sampled steps and flushes. Eager only: a second copy of gradwatch in a process
cannot define the compiled taps' ops (``capture/host_branch.py``), so compiled code would not
compare like with like.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.contenders import GradientRead  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import allocator_option, gradwatch_logger_at, use_allocator  # noqa: E402



def import_revision(rev: str, into: str) -> object:
    """Revision ``rev``'s ``gradwatch`` package, extracted under ``into`` and imported as ``gradwatch_old``.

    Raises:
        RuntimeError: git cannot archive ``rev`` (not a revision of this repository).
    """
    archive = os.path.join(into, "gradwatch.tar")
    done = subprocess.run(["git", "-C", ROOT, "archive", "-o", archive, rev, "gradwatch"],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"git archive {rev!r} failed ({done.stderr.strip()}); pass a revision of this repository")
    with tarfile.open(archive) as tar:
        tar.extractall(into, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    os.rename(os.path.join(into, "gradwatch"), os.path.join(into, "gradwatch_old"))
    for name in [name for name in sys.modules if name == "gradwatch_old" or name.startswith("gradwatch_old.")]:
        del sys.modules[name]  # an earlier call's revision
    sys.path.insert(0, into)  # kept: the package imports some modules when first used
    return importlib.import_module("gradwatch_old")


def measure(workload, old_package, steps: int, flush_every: int = 50, warmup: int = 10) -> dict[str, float]:
    """Medians in microseconds (see the module docstring) over ``steps`` interleaved training steps."""
    import gradwatch

    torch.manual_seed(0)
    models = [workload.make_model() for _ in range(3)]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    x, y = workload.make_batch(torch.device("cpu"))
    monitors = [gradwatch.GradMonitor(models[0], flush_every=flush_every),
                old_package.GradMonitor(models[1], flush_every=flush_every)]  # fmt: skip
    plan = monitors[0]._recorder.flags  # both follow the same plan
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-4) for m in models]
    floor = GradientRead(list(models[2].parameters()), cpu=True)
    calls = [monitors[0].step, monitors[1].step, floor.read]
    times: dict[str, list[list[float]]] = {"unsampled": [[], [], []], "sampled or flush": [[], [], []]}
    orders = [[0, 1, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0], [1, 0, 2], [0, 2, 1]]
    gc.disable()
    try:
        for step in range(steps):
            kind = "sampled or flush" if plan.sampling or (step + 1) % flush_every == 0 else "unsampled"
            for k in orders[step % len(orders)]:
                workload.loss(models[k](x), y).backward()
                t0 = time.perf_counter()
                calls[k]()
                elapsed = time.perf_counter() - t0
                optimizers[k].step()
                optimizers[k].zero_grad(set_to_none=True)
                if step >= warmup:
                    times[kind][k].append(elapsed * 1e6)
    finally:
        gc.enable()
        for monitor in monitors:
            monitor.close()
    figures: dict[str, float] = {}
    for kind, (new, old, floor) in times.items():
        if not new:
            continue
        figures[f"{kind}: steps"] = len(new)
        figures[f"{kind}: new"], figures[f"{kind}: old"], figures[f"{kind}: floor"] = map(np.median, (new, old, floor))
        figures[f"{kind}: new - old, paired"] = float(np.median(np.subtract(new, old)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", required=True, help="the revision to compare with (e.g. HEAD, a commit)")
    parser.add_argument("--workload", choices=sorted(W.BY_NAME), default="mlp")
    parser.add_argument("--steps", type=int, default=400)
    allocator_option(parser)
    args = parser.parse_args()
    print(f"# allocator {use_allocator(args.allocator)}")
    with tempfile.TemporaryDirectory() as into, gradwatch_logger_at(logging.ERROR):
        old = import_revision(args.rev, into)
        logging.getLogger("gradwatch_old").setLevel(logging.ERROR)
        figures = measure(W.BY_NAME[args.workload](), old, args.steps)
    for label, value in figures.items():
        print(f"{label:36s} {value:6.0f}" if label.endswith("steps") else f"{label:36s} {value:8.1f} us")


if __name__ == "__main__":
    main()
