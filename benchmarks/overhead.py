"""gradwatch's step-time overhead against an unmonitored run and the usual alternatives.

    python benchmarks/overhead.py                      # every section (about half an hour on 2 CPU cores)
    python benchmarks/overhead.py --quick              # fewer rounds, for a smoke test
    python benchmarks/overhead.py --only compiled,depth  # some sections: standard, real, compiled, depth, flush, steady

Every figure is a ratio to an unmonitored copy of the same model measured in the
same process, contenders interleaved step by step in orders where each follows every
other equally often (harness.balanced_orders); "none (A/A)" is a second unmonitored copy: its ratio is the noise floor.
"ratio" compares medians (a typical non-flush step); "paired" is the median over
rounds of each step's time over the unmonitored step of the same round, with a
bootstrap 95% interval (pairing cancels the machine's slow drift); "mean ratio"
compares means, so it includes the cost of flushes amortised over the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import resource
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import contenders as C  # noqa: E402
from benchmarks.compiled_floor import CompiledContractReadFloor, CompiledJudgedReadFloor  # noqa: E402
from benchmarks.regional_floor import RegionalJudgedReadFloor  # noqa: E402
from benchmarks import workloads as W  # noqa: E402
from benchmarks.harness import (  # noqa: E402
    allocator_option,
    creation_order_for,
    gradwatch_logger_at,
    figure_table,
    format_table,
    host_syncs_between_flushes,
    measure,
    ops_per_step,
    paired_ratio,
    per_layer_us,
    use_allocator,
    window_gap,
)

#: The contenders of the real-model tables (each step takes 0.2-0.5 s on 2 CPU cores).
REAL_MODEL_CONTENDERS = [
    C.Unmonitored, C.UnmonitoredControl, C.gradwatch_contender(50), C.gradwatch_contender(50, detail="full"),
    C.LightningGradNorm, C.ReadOnceFloor,
]  # fmt: skip


def op_table(workload, device: torch.device) -> dict[str, float]:
    """Aten ops per step: unmonitored, gradwatch's default and full detail (deterministic counts)."""
    plain = ops_per_step(workload, C.Unmonitored, device, window=5, counted=5)
    standard = ops_per_step(workload, C.gradwatch_contender(50), device)
    full = ops_per_step(workload, C.gradwatch_contender(50, detail="full"), device, counted=5)
    print(f"aten ops per step: unmonitored {plain:.1f}, gradwatch default {standard:.1f} (+{standard / plain - 1:.1%}), "
          f"full detail {full:.1f} (+{full / plain - 1:.1%})")  # fmt: skip
    return {"unmonitored": plain, "standard": standard, "full": full}


#: Compiled runs: the model as torch.compile(model) (inductor) for each contender, each with a cache
#: of its own (``contenders.compile_alone``), against the same model compiled without gradwatch;
#: the eager unmonitored step for scale.
COMPILED_CONTENDERS = [
    C.compiled(C.Unmonitored, "none, compiled"), C.compiled(C.UnmonitoredControl, "none (A/A), compiled"),
    C.compiled(C.gradwatch_contender(50), "gradwatch flush=50, compiled"),
    C.compiled(C.gradwatch_contender(50, detail="full"), "gradwatch flush=50 full, compiled"),
    C.compiled(C.DefaultStepFloor, "default's read floor, compiled"), C.Unmonitored,
]  # fmt: skip

#: The depth sweep: the default against the floors of what it reads, per monitored layer.
DEPTH_CONTENDERS = [C.Unmonitored, C.UnmonitoredControl, C.EmptyHooks, C.OutputReadFloor, C.DefaultStepFloor,
                    C.gradwatch_contender(50)]  # fmt: skip


def compiled_section(rounds: int, warmup: int, device: torch.device, sync=None) -> dict:
    """Compiled step with gradwatch / compiled step without it: the three standard workloads (MLP 8x512,
    the CNN, the Transformer), and a tiny GPT-2 from transformers with its KV cache off and on
    (unmonitored twice and gradwatch's default only: its compiles are long)."""
    print("\n# compiled training: torch.compile(model), inductor; ratios to the compiled unmonitored step")
    figures = {}
    for workload in (*W.standard(), W.gpt2_tiny(), W.gpt2_tiny(use_cache=True)):
        contenders = COMPILED_CONTENDERS if "gpt2" not in workload.name else COMPILED_CONTENDERS[:3]
        results = measure(workload, contenders, rounds, warmup, device, sync=sync)
        print(format_table(workload.name, results), flush=True)
        for r in results:
            if "out_grad_recorded" in r.report:
                print(f"  {r.name}: output gradients recorded inside compiled code: {r.report['out_grad_recorded']}")
        figures[workload.name] = figure_table(results)
    return figures


def steady_contenders(flush_every: int = 50, compiled: bool = False,
                      device: torch.device | None = None) -> list[type[C.Contender]]:
    """The contenders of the steady-state section, every one that flushes with windows of
    ``flush_every`` steps: gradwatch's default against its read floors (the per-step reads; the
    contract's reads and writes over whole windows; those with the least per-step judgement, which
    the contract's floor leaves out), the usual alternative, the noise floor, and the default without
    its periodic heatmap image (budget 0: an install without the plot extra). ``compiled``: every
    copy compiled whole with inductor, gradwatch against the per-step floor and the contract's floor
    compiled (``compiled_floor.py``: its sampled reads behind gated opaque ops, as gradwatch's
    compiled taps take them; and judged every step, on the host after backward, as the eager one;
    and that judged floor with per-layer tensors, the form equal blocks compiled one by one need to
    share a graph: ``regional_floor.py``).
    ``device`` other than the CPU: without the judged floors, which judge host memory (and refuse
    other devices)."""
    kinds = _steady_kinds(flush_every, compiled)
    if device is not None and torch.device(device).type != "cpu":
        kinds = [k for k in kinds if not issubclass(k, C.JudgedReadFloor)]
    return kinds


def _steady_kinds(flush_every: int, compiled: bool) -> list[type[C.Contender]]:
    if compiled:
        return [
            C.compiled(C.Unmonitored, "none, compiled"), C.compiled(C.UnmonitoredControl, "none (A/A), compiled"),
            C.compiled(C.gradwatch_contender(flush_every), f"gradwatch flush={flush_every}, compiled"),
            C.compiled(C.DefaultStepFloor, "default's read floor, compiled"),
            C.flushing_every(CompiledContractReadFloor, flush_every),
            C.flushing_every(CompiledJudgedReadFloor, flush_every),
            C.flushing_every(RegionalJudgedReadFloor, flush_every),
        ]  # fmt: skip
    return [C.Unmonitored, C.UnmonitoredControl, C.gradwatch_contender(flush_every), C.DefaultStepFloor,
            C.flushing_every(C.ContractReadFloor, flush_every), C.flushing_every(C.JudgedReadFloor, flush_every),
            C.LightningGradNorm, C.gradwatch_contender(flush_every, heatmap_budget=0.0)]  # fmt: skip


def steady_section(windows: int, device: torch.device, flush_every: int = 50,
                   workloads: list[str] | None = None, compiled: bool = False,
                   creation_seed: int | None = None, candidates: list[W.Workload] | None = None,
                   clock: Callable[[], float] = time.perf_counter) -> dict:  # fmt: skip
    """What the default costs over whole windows in steady state: every step of ``windows`` windows
    after the first two, timed interleaved (the first flush imports matplotlib and lays the heatmap
    out, ~0.5 s; the second draws it again, since the first drawing is no measure of the next
    one's cost; after that the image is drawn within its budget). The mean ratio then holds each
    window's sampled steps and its flush in their real proportion, which the paired median (a
    typical, unsampled step) does not see. Then gradwatch's gap to the contract's floor over whole
    windows with its interval, beside the A/A control's (``harness.window_gap``: what one run can
    resolve). ``workloads``: names of the standard workloads to run (default all three);
    ``compiled``: the compiled contenders (:func:`steady_contenders`); ``creation_seed``:
    make the model copies in an order drawn from it (``harness.creation_order_for``; None: as listed);
    ``candidates``: the workloads to choose from (default the standard three); ``clock``: the timer
    (``harness.measure``'s, replaceable by a test)."""
    contenders = steady_contenders(flush_every, compiled, device)
    creation = creation_order_for(len(contenders), creation_seed)
    print(f"\n# steady state{', compiled' if compiled else ''}: {windows} whole windows of {flush_every} steps "
          "after the first two; mean ratios")  # fmt: skip
    figures = {}
    for workload in W.standard() if candidates is None else candidates:
        if workloads and not any(workload.name.startswith(name) for name in workloads):
            continue
        results = measure(workload, contenders, windows * flush_every, 2 * flush_every, device,
                          creation_order=creation, clock=clock)  # fmt: skip
        base = results[0]
        made = "" if creation is None else f"; copies made in the order {creation} of the list below"
        print(f"## {workload.name}  (mean unmonitored step {base.mean * 1e3:.2f} ms{made})")
        figures[workload.name] = {}
        for r in results[1:]:
            paired = paired_ratio(r, base)
            figures[workload.name][r.name] = {"mean_ratio": r.mean / base.mean, "paired_median": paired[0]}
            print(f"{r.name:36s} mean ratio {r.mean / base.mean:6.3f}   paired median {paired[0]:6.3f} "
                  f"[{paired[1]:.3f}, {paired[2]:.3f}]", flush=True)  # fmt: skip
        # by the contenders' kinds (gradwatch's default: the first gradwatch listed)
        of_kind = list(zip(contenders, results))
        watching = [(k, r) for k, r in of_kind if getattr(k, "gradwatch", False)]
        gradwatch = watching[0][1]
        control = next(r for k, r in of_kind if issubclass(k, C.UnmonitoredControl))
        floor = next(r for k, r in of_kind
                     if issubclass(k, C.ContractReadFloor) and not issubclass(k, C.JudgedReadFloor))
        judged = [(getattr(k, "gap_label", "gradwatch above the contract's floor judged every step"), r)
                  for k, r in of_kind if issubclass(k, C.JudgedReadFloor)]  # (the CPU's runs)
        step_floor = next(r for k, r in of_kind
                          if issubclass(k, C.DefaultStepFloor) and not issubclass(k, (C.ContractReadFloor, C.OutputReadFloor)))
        # the default without its periodic heatmap image (budget 0: what an install without matplotlib
        # pays; the contract's floor draws no image, and one drawing in a run of 8 windows is ~0.3 point)
        imageless = [r for k, r in watching if k.image_budget == 0.0]
        gaps = [("gradwatch above the contract's floor", gradwatch, floor),
                *(("gradwatch without the periodic image above the contract's floor", r, floor) for r in imageless),
                *((label, gradwatch, r) for label, r in judged),
                ("gradwatch above the per-step floor", gradwatch, step_floor),
                ("A/A: the control above the unmonitored run", control, base)]  # fmt: skip
        for label, upper, lower in gaps:
            gap = window_gap(base, upper, lower, flush_every)
            figures[workload.name][label] = gap
            # (and in time: a point is a smaller time on a faster CPU, where the same host work reads larger)
            print(f"  {label}: {gap[0]:+.2f} points [{gap[1]:+.2f}, {gap[2]:+.2f}] over {gap[3]} windows "
                  f"(~{gap[0] * base.mean * 10:+.3f} ms a step)", flush=True)  # fmt: skip
        watched_kinds = {k for k, _ in watching}
        for watched in (r for k, r in of_kind if k in watched_kinds or issubclass(k, C.DefaultStepFloor)):
            parts = window_parts(base, control, watched, flush_every)
            figures[workload.name][f"parts of {watched.name}"] = parts
            print(f"  where {watched.name}'s mean goes, points of the unmonitored time (A/A in brackets): "
                  + ", ".join(f"{k} {v[0]:+.2f} [{v[1]:+.2f}]" for k, v in parts.items()))  # fmt: skip
    return figures


def window_parts(base, control, watched, flush_every: int) -> dict[str, tuple[float, float]]:
    """A gradwatch contender's time above the unmonitored step, by the kind of step of the window it was
    spent on (rounds start at a window's first step): its sampled steps (the default's plan,
    ``capture.layout.planned_slots``), its flush (the last slot, where the heatmap image is drawn
    when its budget allows), and the rest; in points of the unmonitored total, with the A/A
    control's for the noise."""
    import numpy as np

    from gradwatch.capture.layout import planned_slots
    from gradwatch.settings import DETAILS

    b, c, w = (np.asarray(r.times) for r in (base, control, watched))
    slots = np.arange(len(b)) % flush_every
    sampled = planned_slots(flush_every, DETAILS["standard"])[slots]
    flush = slots == flush_every - 1
    kinds = {"sampled steps": sampled & ~flush, "flush": flush, "other steps": ~sampled & ~flush}
    total = b.sum()
    return {k: (float((w[m] - b[m]).sum() / total * 100), float((c[m] - b[m]).sum() / total * 100))
            for k, m in kinds.items()}  # fmt: skip


def depth_section(rounds: int, warmup: int, device: torch.device, depths: tuple[int, ...], sync=None) -> dict:
    """Cost per monitored layer against depth (Linear + LayerNorm + ReLU blocks, width 256,
    batch 256, Adam), beside the floors: an empty hook, the output sum, the default's reads."""
    print("\n## cost per monitored layer against depth (blocks of Linear + LayerNorm + ReLU, width 256, "
          "batch 256, Adam, flush_every=50): median over rounds of (step - unmonitored step) / layers, in us")
    names = [k.name for k in DEPTH_CONTENDERS[1:]]
    print(f"{'blocks':>6s} {'layers':>6s} {'step ms':>8s} " + " ".join(f"{n[:22]:>23s}" for n in names)
          + f" {'gradwatch ratio':>16s}")  # fmt: skip
    figures = {}
    for depth in depths:
        workload = W.deep_mlp(depth)
        layers = 2 * depth + 1
        res = measure(workload, DEPTH_CONTENDERS, rounds, warmup, device, sync=sync)
        costs = {r.name: per_layer_us(r, res[0], layers) for r in res[1:]}
        ratio = paired_ratio(res[-1], res[0])
        figures[depth] = {"layers": layers, "step_ms": res[0].median * 1e3, "per_layer_us": costs,
                          "gradwatch_paired_ratio": ratio}  # fmt: skip
        print(f"{depth:6d} {layers:6d} {res[0].median * 1e3:8.2f} " + " ".join(f"{costs[n]:23.1f}" for n in names)
              + f" {ratio[0]:7.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]", flush=True)  # fmt: skip
    return figures


def main() -> None:
    with gradwatch_logger_at(logging.ERROR):  # random-label tasks are not the point here
        _main()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds of the standard section (default 100, 20 with --quick); the others scale "
                             "from it: real models a third (at least 8), compiled and depth half (at least 10), "
                             "flush_every at least 200")  # fmt: skip
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--skip-scaling", action="store_true", help="skip the depth and flush_every sweeps")
    parser.add_argument("--skip-real", action="store_true", help="skip the real-model tables (ResNet-18, GPT-2, ViT)")
    parser.add_argument("--skip-ops", action="store_true", help="skip the op counts (slow: every op through Python)")
    parser.add_argument("--only", help="comma-separated sections: standard, real, compiled, depth, flush, steady")
    parser.add_argument("--windows", type=int, default=4, help="steady section: whole windows timed (default 4)")
    parser.add_argument("--workloads", help="steady section: comma-separated, of mlp, resnet, transformer (default all)")
    parser.add_argument("--compiled", action="store_true", help="steady section: every copy compiled (inductor)")
    parser.add_argument("--creation-seed", type=int, default=None,
                        help="steady section: make the model copies in an order drawn from this seed (default: as "
                             "listed); give each process its own, so that an average over processes does not carry "
                             "a copy's place in memory")  # fmt: skip
    allocator_option(parser)
    args = parser.parse_args()
    allocator = use_allocator(args.allocator)
    sections = set(args.only.split(",")) if args.only else {"standard", "real", "compiled", "depth", "flush", "steady"}
    if args.skip_real:
        sections.discard("real")
    if args.skip_scaling:
        sections -= {"depth", "flush"}
    rounds = args.rounds or (20 if args.quick else 100)
    warmup = 3 if args.quick else 10
    device = torch.device("cpu")
    print(f"# gradwatch overhead  torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"allocator {allocator}")  # fmt: skip
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "workloads": {},
                    "allocator": allocator}

    for workload in W.standard() if "standard" in sections else []:
        results = measure(workload, C.standard(), rounds, warmup, device)
        print(format_table(workload.name, results), flush=True)
        plain, watched = host_syncs_between_flushes(workload, device)
        print(f"host syncs in 8 non-flush steps: unmonitored {plain}, gradwatch {watched}")
        report["workloads"][workload.name] = figure_table(results)
        if not args.skip_ops:
            report["workloads"][workload.name]["aten_ops_per_step"] = op_table(workload, device)

    if "real" in sections:
        real_rounds = max(rounds // 3, 8)
        print(f"\n# real architectures built from configs ({real_rounds} rounds; AdamW as in the tables above)")
        report["real_models"] = {}
        for workload in W.real_models():
            results = measure(workload, REAL_MODEL_CONTENDERS, real_rounds, 3, device)
            print(format_table(workload.name, results), flush=True)
            report["real_models"][workload.name] = figure_table(results)

    if "compiled" in sections:
        report["compiled"] = compiled_section(max(rounds // 2, 10), warmup, device)

    if "steady" in sections:
        report["steady"] = steady_section(1 if args.quick else args.windows, device,
                                          workloads=args.workloads.split(",") if args.workloads else None,
                                          compiled=args.compiled, creation_seed=args.creation_seed)  # fmt: skip

    if "depth" in sections:
        depths = (16, 64) if args.quick else (16, 64, 256)
        report["depth"] = depth_section(max(rounds // 2, 10), warmup, device, depths)

    if "flush" in sections:
        print("\n## overhead against flush_every (MLP 8x512)")
        print(f"{'flush_every':>12s} {'ratio':>7s} {'mean ratio':>11s}")
        flushes = (1, 10, 50, 200)
        res = measure(W.mlp(), [C.Unmonitored] + [C.gradwatch_contender(f) for f in flushes],
                      max(rounds, 200), warmup, device)  # fmt: skip
        report["flush_every"] = {}
        for f, r in zip(flushes, res[1:]):
            report["flush_every"][f] = {"ratio": r.median / res[0].median, "mean_ratio": r.mean / res[0].mean}
            print(f"{f:12d} {r.median / res[0].median:7.3f} {r.mean / res[0].mean:11.3f}", flush=True)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\nprocess peak RSS: {peak / (1 << 20):.0f} MiB (all contenders together; "
          "gradwatch's own device memory is the 'buffer' column)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)



if __name__ == "__main__":
    main()
