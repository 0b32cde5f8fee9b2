"""GPU check: the benchmark workloads on CUDA, with host syncs made errors between flushes.

    python benchmarks/gpu_check.py                          # everything: about 5-8 minutes on one GPU
    python benchmarks/gpu_check.py --quick --json out.json  # #30's figures only: about 2-4 minutes
    benchmarks/gpu_run.sh                                   # on a lent device: the GPU tests, then --quick

1. No sync: ``torch.cuda.set_sync_debug_mode("error")`` around gradwatch's non-flush steps
   (forward, backward, monitor.step(), optimizer step), for the default (detail="standard":
   sampled and unsampled steps) and detail="full", eager and under torch.compile: any
   synchronising call raises.
2. Device ops: aten ops per step of the default against an unmonitored step (the MLP and the
   Transformer; #30 asks +5%), and a launch-bound step (MLP 8x64, batch 8): gradwatch's ratio
   beside the default's per-step read floor and the contract's (``ContractReadFloor``), and the
   host time of ``monitor.step()`` on unsampled steps.
   What the device runs (kernels, memcpys, memsets, by ``torch.profiler``) in one unsampled and
   one sampled step, against the unmonitored step (``kernel_count.py``): aten ops are not always
   one launch each.
   The flush's host time by part (``flush_cost.py``; on a device the flush step also waits for
   the queued steps to finish, the one sync of a window).
3. Overhead: the interleaved ratio (and paired per-round ratio) to an unmonitored copy, steps
   timed with synchronize: the standard workloads eager, and compiled (gradwatch compiled into
   the model against the same model compiled without it, the per-step read floor and the
   contract's read floor compiled beside it, ``compiled_floor.py``; eager, the contract's read
   floor too: what the default must read and write over whole windows). Without
   ``--quick`` every contender of the CPU tables, the depth sweep and the real models too.

The device's budget is short (15 minutes a session in this project, the machine's start
included), so ``--quick`` measures exactly what #30 asks of a device and ``--json`` keeps the
figures even when a later part runs out of time (the file is rewritten after every part).
``--device cpu`` runs the same code on the CPU (the test suite's smoke test, ``--tiny``
workloads): there the no-sync check counts host reads against an unmonitored loop instead.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import contenders as C  # noqa: E402
from benchmarks.compiled_floor import CompiledContractReadFloor  # noqa: E402
from benchmarks import flush_cost  # noqa: E402
from benchmarks import kernel_count  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    figure_table,
    format_table,
    gradwatch_logger_at,
    host_syncs_between_flushes,
    measure,
)

#: The contenders of the quick eager tables: the noise floor, the default, its per-step read floor and
#: the contract's (whole windows: sampled steps and flushes too; #30's target is stated against it),
#: and the per-step alternative users pick (Lightning's grad_norm logged every step).
QUICK_CONTENDERS = [C.Unmonitored, C.UnmonitoredControl, C.gradwatch_contender(50), C.DefaultStepFloor,
                    C.ContractReadFloor, C.LightningGradNorm]  # fmt: skip
#: The compiled contenders of the quick tables: each is one compile of the model (tens of seconds), so
#: no A/A copy here; the compiled tables come last, where a run cut short loses the least.
QUICK_COMPILED = [C.compiled(C.Unmonitored, "none, compiled"),
                  C.compiled(C.gradwatch_contender(50), "gradwatch flush=50, compiled"),
                  C.compiled(C.DefaultStepFloor, "default's read floor, compiled"),
                  CompiledContractReadFloor]  # fmt: skip


def no_sync_check(workload, device: torch.device, steps: int = 30, detail: str = "standard",
                  compiled: bool = False) -> str:  # fmt: skip
    """Whether ``steps`` non-flush steps (sampled and unsampled) synchronise: on CUDA any
    synchronising call raises; elsewhere host reads are counted against an unmonitored loop."""
    if device.type != "cuda":
        plain, watched = host_syncs_between_flushes(workload, device, steps=min(steps, 8))
        return f"ok: {watched} host reads, as the unmonitored loop's {plain}" if plain == watched else \
            f"SYNC DETECTED: {watched} host reads against the unmonitored loop's {plain}"
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


def launch_bound(device: torch.device, rounds: int = 200, workload=None) -> dict[str, Any]:
    """A step bound by launching kernels (an MLP 8x64 at batch 8: microseconds of device work per
    kernel): gradwatch's ratio beside the default's read floors (per step; the contract's, whole
    windows), and the host time of ``step()`` on steps that are not sampled, timed in context (no
    synchronize inside it)."""
    from gradwatch import GradMonitor

    workload = workload or W.mlp(depth=8, width=64, batch=8)
    contenders = [C.Unmonitored, C.UnmonitoredControl, C.gradwatch_contender(50), C.DefaultStepFloor,
                  C.ContractReadFloor]  # fmt: skip
    results = measure(workload, contenders, rounds, 20, device, sync=_sync(device))
    print(format_table(f"{workload.name} (launch-bound)", results), flush=True)
    torch.manual_seed(0)
    model = workload.make_model().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = workload.make_batch(device)
    monitor = GradMonitor(model, flush_every=50)
    host: list[float] = []
    for step in range(rounds):
        workload.loss(model(x), y).backward()
        sampled = monitor._recorder.flags.sampling
        start = time.perf_counter()
        monitor.step()
        if not sampled and step % 50 != 49:  # neither a sampled step nor a flush
            host.append(time.perf_counter() - start)
        opt.step()
        opt.zero_grad(set_to_none=True)
    monitor.close()
    host.sort()
    layers = len(monitor.layers)
    median_us = host[len(host) // 2] * 1e6 if host else float("nan")
    print(f"monitor.step() host time on unsampled steps: median {median_us:.0f} us "
          f"({median_us / layers:.1f} us per layer, {layers} layers)", flush=True)  # fmt: skip
    return {"table": figure_table(results), "step_host_us": median_us, "layers": layers}


def overhead_tables(workloads, contenders, rounds: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Interleaved tables of ``contenders`` on each workload, steps timed with synchronize."""
    figures = {}
    for workload in workloads:
        results = measure(workload, contenders, rounds=rounds, warmup=warmup, device=device, sync=_sync(device))
        print(format_table(workload.name, results), flush=True)
        figures[workload.name] = figure_table(results)
        if device.type == "cuda":
            print(f"peak memory {torch.cuda.max_memory_allocated() / (1 << 20):.0f} MiB (all contenders)")
    return figures


def quick_parts(device: torch.device, workloads: dict[str, list], rounds: int) -> list[tuple[str, Callable[[], Any]]]:
    """What #30 asks of a device, in the order run: (name in the JSON report, the part)."""
    from benchmarks.overhead import op_table

    def no_sync() -> dict[str, str]:
        checks = {f"{w.name} ({detail})": no_sync_check(w, device, detail=detail)
                  for w in workloads["eager"] for detail in ("standard", "full")}  # fmt: skip
        checks.update({f"{w.name} (standard, compiled)": no_sync_check(w, device, compiled=True)
                       for w in workloads["compiled_no_sync"]})  # fmt: skip
        for name, result in checks.items():
            print(f"{name}: {result}", flush=True)
        return checks

    def ops() -> dict[str, Any]:
        counts = {}
        for workload in workloads["ops"]:  # kernels launched per step: the default's budget is +5%
            print(workload.name, end=": ")
            counts[workload.name] = op_table(workload, device)
        return counts

    def device_work() -> dict[str, Any]:  # what the device runs in one sampled and one unsampled step
        return {workload.name: kernel_count.measure(workload, device) for workload in workloads["ops"]}

    return [
        ("no_sync", no_sync),
        ("aten_ops_per_step", ops),
        ("device_work_per_step", device_work),
        ("launch_bound", lambda: launch_bound(device, rounds=4 * rounds, workload=workloads["launch_bound"])),
        ("flush", lambda: flush_cost.measure(workloads["flush"], windows=3, device=device)),
        ("eager", lambda: overhead_tables(workloads["eager"], QUICK_CONTENDERS, rounds, 10, device)),
        ("compiled", lambda: overhead_tables(workloads["compiled"], QUICK_COMPILED, rounds // 2, 10, device)),
    ]


def full_parts(device: torch.device) -> list[tuple[str, Callable[[], Any]]]:
    """Everything else, without ``--quick``: every contender of the CPU tables, the compiled section
    (GPT-2 included), the depth sweep and the real models."""
    from benchmarks.overhead import REAL_MODEL_CONTENDERS, compiled_section, depth_section

    sync = _sync(device)
    return [
        ("all_contenders", lambda: overhead_tables(W.standard(), C.standard(), 100, 10, device)),
        ("compiled_section", lambda: compiled_section(50, 10, device, sync=sync)),
        ("depth", lambda: depth_section(30, 5, device, (16, 64, 256), sync=sync)),
        ("real_models", lambda: overhead_tables(W.real_models(), REAL_MODEL_CONTENDERS, 30, 5, device)),
    ]


def standard_workloads(tiny: bool, quick: bool = True) -> dict[str, Any]:
    """The workloads of each quick part; ``tiny``: small stand-ins (the CPU smoke test); ``quick``:
    the compiled no-sync check on the MLP only (each compile takes tens of seconds)."""
    if tiny:
        mlp = W.mlp(depth=2, width=16, batch=8)
        # no compiled table: one compile of each contender would take most of the smoke test's time
        return {"eager": [mlp], "compiled_no_sync": [], "ops": [mlp], "launch_bound": mlp, "flush": mlp,
                "compiled": []}  # fmt: skip
    compiled_no_sync = [W.mlp()] if quick else [W.mlp(), W.transformer()]
    return {"eager": W.standard(), "compiled_no_sync": compiled_no_sync, "ops": [W.mlp(batch=64), W.transformer()],
            "launch_bound": W.mlp(depth=8, width=64, batch=8), "flush": W.mlp(batch=32),
            "compiled": [W.mlp(), W.transformer()]}  # fmt: skip


def run_parts(parts: list[tuple[str, Callable[[], Any]]], report: dict[str, Any], json_path: str | None) -> None:
    """Run each part, keeping its figures (or the error that stopped it) in ``report``, written to
    ``json_path`` after every part: a run cut short keeps what it measured."""
    for name, part in parts:
        start = time.perf_counter()
        try:
            report[name] = part()
        except Exception as exc:  # one part's failure (an old torch, a missing package) costs that part only
            report[name] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})", flush=True)
        report.setdefault("seconds", {})[name] = round(time.perf_counter() - start, 1)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2, default=str)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only what #30 asks of a device (about 2-4 minutes)")
    parser.add_argument("--json", help="write the figures here (rewritten after every part)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run")
    parser.add_argument("--rounds", type=int, default=100, help="rounds of the quick eager tables (default 100)")
    parser.add_argument("--tiny", action="store_true", help="small stand-in workloads (the test suite's smoke run)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return {}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# gradwatch GPU check  torch {torch.__version__}, {name}", flush=True)
    report: dict[str, Any] = {"torch": torch.__version__, "device": name}
    parts = quick_parts(device, standard_workloads(args.tiny, args.quick), args.rounds)
    if not args.quick:  # the full run's tables hold the quick ones' contenders
        parts = [(n, p) for n, p in parts if n not in ("eager", "compiled")] + full_parts(device)
    # Quiet while it runs (random-label tasks alert); restored for a caller that runs it in-process
    # (the smoke test), whose later warnings would be lost otherwise.
    with gradwatch_logger_at(logging.ERROR):
        run_parts(parts, report, args.json)
    return report


def _sync(device: torch.device) -> Callable[[], None] | None:
    return torch.cuda.synchronize if device.type == "cuda" else None


if __name__ == "__main__":
    main()
