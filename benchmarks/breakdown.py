"""Where gradwatch's step time goes: ablations and in-context per-call costs.

    python benchmarks/breakdown.py                 # MLP 8x512
    python benchmarks/breakdown.py --workload cnn  # or transformer

Ablations are gradwatch monitors with one part switched off (by replacing a
method on that monitor's own objects, so the other contenders are untouched),
measured like overhead.py: interleaved in balanced orders, against an unmonitored copy.
The floors are the least any monitor pays that reads the same tensors with
separate reductions. "In-context cost" times single calls made inside the
forward hooks of a real training step, where the GEMMs have just evicted
Python's working set from the caches: these are the prices that count, and
they are several times what the same call costs in a tight loop.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import contenders as C  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import format_table, gradwatch_logger_at, measure  # noqa: E402

_GradWatch50 = C.gradwatch_contender(50)


class WithoutParamStats(_GradWatch50):
    name = "gradwatch w/o param-grad stats"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        stats = self.monitor._recorder.param_stats
        stats.record = lambda rows, present: None


class WithoutOutputGradReductions(_GradWatch50):
    """Tensor hooks are still registered and called; they reduce nothing."""

    name = "gradwatch w/o out-grad reductions"

    def __init__(self, model, workload, device):
        super().__init__(model, workload, device)
        for tap in self.monitor._recorder.cells.taps:
            tap.grad_tap._record = lambda grad, shared: None


def in_context_costs(workload, steps: int = 120, clock=time.perf_counter) -> dict[str, float]:
    """Median microseconds of one call made in the forward hook of each parametrised leaf layer
    (``clock``: the timer, replaceable by a test)."""
    torch.manual_seed(0)
    model = workload.make_model()
    x, y = workload.make_batch(torch.device("cpu"))
    samples: dict[str, list[float]] = {"empty hook body": [], "out.register_hook": [], "out.sum()": []}
    names = list(samples)
    mode = [names[0]]

    def noop(grad):
        return None

    def forward_hook(module, args, out):
        if not isinstance(out, torch.Tensor):
            return
        t0 = clock()
        if mode[0] == "out.register_hook" and out.requires_grad:
            out.register_hook(noop)
        elif mode[0] == "out.sum()":
            out.detach().sum()
        samples[mode[0]].append(clock() - t0)

    handles = [
        m.register_forward_hook(forward_hook)
        for m in model.modules()
        if any(True for _ in m.parameters(recurse=False)) and not any(True for _ in m.children())
    ]
    gc.disable()
    try:
        for step in range(steps):
            mode[0] = names[step % len(names)]
            loss = workload.loss(model(x), y)
            loss.backward()
            model.zero_grad(set_to_none=True)
    finally:
        gc.enable()
        for h in handles:
            h.remove()
    return {k: statistics.median(v[len(v) // 5 :]) * 1e6 for k, v in samples.items()}


def cold_call_costs(workload, steps: int = 120, clock=time.perf_counter) -> dict[str, float]:
    """Median microseconds, right after a real step's backward (where ``monitor.step()`` runs), of:
    the one read of every parameter gradient (``_foreach_norm``), then three small calls of the
    kind gradwatch's bookkeeping makes (a ``stack``, a ``square`` into a float64 row, a numpy sum of
    the row), and the same three calls again. The second round shows what the first pays for its
    code and data having left the caches during the step (``clock``: replaceable by a test)."""
    torch.manual_seed(0)
    model = workload.make_model()
    x, y = workload.make_batch(torch.device("cpu"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    norms = torch.zeros(len(params))
    row = torch.zeros(len(params), dtype=torch.float64)
    host_row = row.numpy()
    names = ["gradient read (_foreach_norm)", "stack", "square into float64", "numpy sum", "stack, again",
             "square, again", "numpy sum, again"]  # fmt: skip
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.disable()
    try:
        for _ in range(steps):
            workload.loss(model(x), y).backward()
            grads = [p.grad for p in params]
            times = [clock()]
            per_tensor = torch._foreach_norm(grads, 2)
            times.append(clock())
            for _ in range(2):
                torch.stack(per_tensor, out=norms)
                times.append(clock())
                torch.square(norms, out=row)
                times.append(clock())
                float(host_row.sum())
                times.append(clock())
            for name, t0, t1 in zip(names, times, times[1:]):
                samples[name].append(t1 - t0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        gc.enable()
    return {k: statistics.median(v[len(v) // 5 :]) * 1e6 for k, v in samples.items()}


def main() -> None:
    with gradwatch_logger_at(logging.ERROR):
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(W.BY_NAME), default="mlp")
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    workload = W.BY_NAME[args.workload]()
    print(f"# gradwatch cost breakdown  torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = measure(
        workload,
        [C.Unmonitored, C.UnmonitoredControl, _GradWatch50, WithoutParamStats, WithoutOutputGradReductions,
         C.ReadOnceFloor, C.DefaultStepFloor, C.FusedFloor],
        args.rounds,
        10,
        torch.device("cpu"),
    )  # fmt: skip
    print(format_table(workload.name, results))
    print("\nin-context cost of one call in a forward hook (median us):")
    for name, us in in_context_costs(workload).items():
        print(f"  {name:20s} {us:8.1f}")
    print("\nright after backward, where monitor.step() runs (median us):")
    for name, us in cold_call_costs(workload).items():
        print(f"  {name:30s} {us:8.1f}")


if __name__ == "__main__":
    main()
