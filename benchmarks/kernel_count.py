"""Device work launched per training step, gradwatch against an unmonitored twin (#30).

    python benchmarks/kernel_count.py                 # CUDA: MLP 8x512 and the Transformer
    python benchmarks/kernel_count.py --device cpu    # aten ops instead (no device to count on)

The op-count test counts aten ops, which stand for kernel launches. On a device they are not
always one each: ``_foreach_norm`` launches two kernels, and an order its fast path does not take
(anything but 1, 2 and inf on CUDA; the non-finite count's 0) one per tensor; a copy to the host
is a memcpy, not a kernel. Here ``torch.profiler`` counts what the device ran (kernels, memcpys,
memsets) in one step of each kind: an unsampled one (#30: at most one kernel per layer above the
unmonitored step, plus a fixed few) and a sampled one, the second window's, after a first window
that builds every cache. On the CPU there is no device activity to count, so the same steps count
aten ops (``harness.OpCounter``) on the path a device takes, which is what the suite's tests bound.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import OpCounter  # noqa: E402

#: slots of a 10-step window: 0 is sampled, 3 is not (the default samples slots 0 and 1 of a window this short)
_SLOTS = {"sampled": 0, "unsampled": 3}
_WINDOW = 10


class _DeviceCounter:
    """Device activities (kernels, memcpys, memsets) run inside it, by kind and by name."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CUDA])
        self.by_kind: collections.Counter = collections.Counter()
        self.by_name: collections.Counter = collections.Counter()

    def __enter__(self) -> "_DeviceCounter":
        self._profile.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.synchronize()
        self._profile.__exit__(*exc)
        for event in self._profile.events():
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            name = event.name
            kind = "memcpy" if name.startswith("Memcpy") else "memset" if name.startswith("Memset") else "kernel"
            self.by_kind[kind] += 1
            self.by_name[name] += 1

    @property
    def count(self) -> int:
        return sum(self.by_kind.values())


def _counter(device: torch.device) -> Any:
    return _DeviceCounter() if device.type == "cuda" else OpCounter()


def step_counts(workload, device: torch.device, monitored: bool) -> tuple[dict[str, Any], int]:
    """({"sampled"/"unsampled": counter}, layers) for one model trained a window and a few steps."""
    from gradwatch import GradMonitor

    torch.manual_seed(0)
    model = workload.make_model().to(device)
    x, y = workload.make_batch(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    monitor = GradMonitor(model, flush_every=_WINDOW) if monitored else None
    counted = {_WINDOW + slot: name for name, slot in _SLOTS.items()}
    counters: dict[str, Any] = {}
    for step in range(_WINDOW + max(_SLOTS.values()) + 1):
        name = counted.get(step)
        counter = _counter(device) if name else None
        with counter if counter is not None else contextlib.nullcontext():
            workload.loss(model(x), y).backward()
            if monitor is not None:
                monitor.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if name:
            counters[name] = counter
    layers = len(monitor.layers) if monitor is not None else 0
    if monitor is not None:
        monitor.close()
    return counters, layers


@contextlib.contextmanager
def _accelerators_path(device: torch.device):
    """On the CPU, the path a device takes (as the op-count tests do): the CPU's own path reads
    host memory and takes other reductions, whose ops say nothing of a device's launches."""
    import gradwatch.capture.param_stats as param_stats
    from gradwatch import registry

    saved = param_stats.CPU_FAST_PATH, registry.outputs.CPU_ROWS
    if device.type == "cpu":
        param_stats.CPU_FAST_PATH, registry.outputs.CPU_ROWS = False, False
    try:
        yield
    finally:
        param_stats.CPU_FAST_PATH, registry.outputs.CPU_ROWS = saved


def measure(workload, device: torch.device) -> dict[str, Any]:
    """What one unsampled and one sampled step launch, unmonitored and with the default (on the CPU:
    aten ops of the accelerators' path)."""
    plain, _ = step_counts(workload, device, monitored=False)
    with _accelerators_path(device):
        watched, layers = step_counts(workload, device, monitored=True)
    unit = "device activities" if device.type == "cuda" else "aten ops"
    report: dict[str, Any] = {"unit": unit, "layers": layers}
    for name in _SLOTS:
        extra = watched[name].count - plain[name].count
        figures = {"unmonitored": plain[name].count, "gradwatch": watched[name].count, "extra": extra,
                   "extra per layer": round(extra / max(layers, 1), 2)}  # fmt: skip
        if device.type == "cuda":
            added = watched[name].by_name.copy()
            added.subtract(plain[name].by_name)
            figures["by kind"] = dict(watched[name].by_kind)
            figures["most added"] = [(k, n) for k, n in added.most_common(8) if n > 0]
        report[name] = figures
        print(f"{workload.name} {name}: {plain[name].count} -> {watched[name].count} {unit} "
              f"(+{extra}, {figures['extra per layer']} per layer, {layers} layers)", flush=True)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = {w.name: measure(w, device) for w in (W.mlp(batch=64), W.transformer())}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
