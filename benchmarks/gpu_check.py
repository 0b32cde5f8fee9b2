"""GPU check: the benchmark workloads on CUDA, with host syncs made errors between flushes.

    python benchmarks/gpu_check.py     # about 5-8 minutes on one GPU

1. No sync: ``torch.cuda.set_sync_debug_mode("error")`` around gradwatch's non-flush steps
   (forward, backward, monitor.step(), optimizer step), for the default (detail="standard":
   sampled and unsampled steps) and detail="full", eager and under torch.compile: any
   synchronising call raises.
2. Overhead: the interleaved ratio (and paired per-round ratio) to an unmonitored copy,
   for the same contenders as the CPU tables (default, full detail, +update_ratio, the
   alternatives, the floors), steps timed with synchronize; the compiled case (gradwatch
   compiled into the model against the same model compiled without it); the depth sweep;
   then the real models.
3. Device ops: aten ops per step of the default against an unmonitored step (the MLP and the
   Transformer), and a launch-bound step (MLP 8x64, batch 8): gradwatch's ratio beside the
   default's read floor, and the host time of ``monitor.step()`` on unsampled steps.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import contenders as C  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import format_table, measure  # noqa: E402


def no_sync_check(workload, device: torch.device, steps: int = 30, detail: str = "standard",
                  compiled: bool = False) -> str:  # fmt: skip
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    kind = C.gradwatch_contender(50, with_optimizer=True, detail=detail)
    watched = (C.compiled(kind) if compiled else kind)(copy.deepcopy(model), workload, device)
    # Adam on CUDA with capturable=False keeps its step counters on the host: no sync there.
    for _ in range(3):
        watched.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):  # steps 3..32 of a 50-step window: none flushes; step 25 is sampled
            watched.step()
    except RuntimeError as exc:
        return f"SYNC DETECTED: {exc}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        watched.close()
    return f"ok: {steps} non-flush steps without a host sync"


def launch_bound(device: torch.device, rounds: int = 200) -> None:
    """A step bound by launching kernels (an MLP 8x64 at batch 8: microseconds of device work per
    kernel): gradwatch's ratio beside the default's read floor, and the host time of ``step()`` on
    steps that are not sampled, timed in context (no synchronize inside it)."""
    import time

    from gradwatch import GradMonitor

    workload = W.mlp(depth=8, width=64, batch=8)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    contenders = [C.Unmonitored, C.UnmonitoredControl, C.gradwatch_contender(50), C.DefaultStepFloor]
    print(format_table(f"{workload.name} (launch-bound)", measure(workload, contenders, rounds, 20, device, sync=sync)))
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = workload.make_batch(device)
    monitor = GradMonitor(model, flush_every=50)
    host: list[float] = []
    for step in range(rounds):
        workload.loss(model(x), y).backward()
        sampled = monitor._recorder.plan.sampling
        start = time.perf_counter()
        monitor.step()
        if not sampled and step % 50 != 49:  # neither a sampled step nor a flush
            host.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    host.sort()
    layers = len(monitor.layers)
    print(f"monitor.step() host time on unsampled steps: median {host[len(host) // 2] * 1e6:.0f} us "
          f"({host[len(host) // 2] * 1e6 / layers:.1f} us per layer, {layers} layers)", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return
    logging.getLogger("gradwatch").setLevel(logging.ERROR)
    device = torch.device("cuda")
    print(f"# gradwatch GPU check  torch {torch.__version__}, {torch.cuda.get_device_name()}")
    for workload in W.standard():
        for detail in ("standard", "full"):
            print(f"{workload.name} ({detail}): {no_sync_check(workload, device, detail=detail)}", flush=True)
    for workload in (W.mlp(), W.transformer()):
        result = no_sync_check(workload, device, compiled=True)
        print(f"{workload.name} (standard, compiled): {result}", flush=True)
    from benchmarks.overhead import op_table

    for workload in (W.mlp(batch=64), W.transformer()):  # kernels launched per step: the default's budget is +5%
        print(workload.name, end=": ")
        op_table(workload, device)
    launch_bound(device)
    contenders = C.standard()  # the CPU tables' contenders, read-once floor included
    for workload in W.standard():
        results = measure(workload, contenders, rounds=100, warmup=10, device=device, sync=torch.cuda.synchronize)
        print(format_table(workload.name, results), flush=True)
        print(f"peak memory {torch.cuda.max_memory_allocated() / (1 << 20):.0f} MiB (all contenders)")
    from benchmarks.overhead import REAL_MODEL_CONTENDERS, compiled_section, depth_section

    sync = torch.cuda.synchronize
    compiled_section(50, 10, device, sync=sync)
    depth_section(30, 5, device, (16, 64, 256), sync=sync)

    for workload in W.real_models():
        results = measure(workload, REAL_MODEL_CONTENDERS, rounds=30, warmup=5, device=device, sync=torch.cuda.synchronize)
        print(format_table(workload.name, results), flush=True)


if __name__ == "__main__":
    main()
