"""Instructions a training step executes, counted by callgrind: gradwatch against the contract's floor (#30).

    python benchmarks/instructions.py --compiled                    # compiled MLP 8x512, batch 16
    python benchmarks/instructions.py --compiled --workload transformer --batch 2
    python benchmarks/instructions.py --compiled --functions 25 --cache-sim

Timings on a shared 2-core machine resolve about a point between contenders in one process, and
where gradwatch's compiled MLP sits ~2 points above its floor, one process cannot say which part is
work gradwatch does and which is a copy's offset. Instruction counts can: callgrind counts what
the CPU executes, the same for the same code and inputs whatever else the machine is doing. This
script runs itself under ``valgrind --tool=callgrind`` with instrumentation off (the imports,
compiling and warm-up run at valgrind's uninstrumented speed), makes three copies of one model
(unmonitored, gradwatch's default, and the contract's read floor: ``contenders.ContractReadFloor``,
compiled ``compiled_floor.CompiledContractReadFloor``; ``--judged``: ``contenders.JudgedReadFloor``, the
least per-step judgement added, compiled ``compiled_floor.CompiledJudgedReadFloor``), steps them interleaved, and counts
``--steps`` unsampled, non-flush steps of each (the step gradwatch takes ~47 times in 50) phase by
phase: the forward and backward, the read (gradwatch's ``step()``, the floor's read; nothing for
the unmonitored copy) and the optimizer's step. Reported: instructions per step and phase, mean
over the counted steps, and gradwatch's and the floor's differences; ``--functions K``: the K
functions whose instructions differ most between gradwatch and the floor, by phase
(``callgrind_annotate``); ``--cache-sim``: also callgrind's simulated cache misses (first level,
and a last level of ``--ll-bytes``, the size of one core's own L2 here) and branch
mispredictions, a model of the memory system, not this machine's.

What counts do not see: stalls on the real memory system (no hardware counters in this guest:
``perf stat`` says "not supported"), other threads' spinning (the copies run on one intra-op
thread here), the kernel's own time. So the difference in instructions is the work gradwatch adds,
and its time at the rest of the step's rate is a bound on the part of a timed gap that this work
explains.

valgrind 3.19 decodes no AVX-512: the child holds ATen (``ATEN_CPU_CAPABILITY``), oneDNN
(``DNNL_MAX_CPU_ISA``), MKL (``MKL_ENABLE_INSTRUCTIONS``) and inductor's generated code
(``config.cpp.march``, compiled by a gcc that runs outside valgrind) to AVX2, with an inductor
cache of its own. The counts are of this process's user space only; GEMMs run ~500 times slower
than natively, so the default batch is small: the host work does not depend on it, and the
kernels are the same for every copy.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the phases of a counted step, in the order their counts are dumped
PHASES = ("forward+backward", "read / step()", "optimizer")
#: the copies, in the order they are made and stepped
COPIES = ("none", "gradwatch", "floor")
#: what valgrind 3.19 can decode: the child's libraries and generated code held to AVX2
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
_CHILD = "GRADWATCH_INSTRUCTIONS_CHILD"


def parse_dump(path: str) -> dict[str, int]:
    """One callgrind dump's totals: event name -> count (its ``events:`` and ``summary:`` lines)."""
    events: list[str] = []
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith(("summary:", "totals:")):
                return dict(zip(events, (int(v) for v in line.split()[1:])))
    raise ValueError(f"{path} holds no summary line: not a callgrind dump (was the run cut short?)")


def dumps_in_order(out_file: str) -> list[str]:
    """The dumps of a run whose ``--callgrind-out-file`` was ``out_file``: ``out_file.1``, ``.2``, ...
    in the order they were made (the file without a number is the end of the run, counted nothing)."""
    numbered = [(int(p.rsplit(".", 1)[1]), p) for p in glob.glob(out_file + ".*") if p.rsplit(".", 1)[1].isdigit()]
    return [p for _, p in sorted(numbered)]


def per_phase(labels: list[list[str]], dumps: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Mean counts per step: copy -> phase -> event -> mean over the copy's counted steps of that
    phase. ``labels[i]``: the (copy, phase) of ``dumps[i]``, as the child wrote them."""
    if len(labels) != len(dumps):
        raise ValueError(f"{len(dumps)} dumps for {len(labels)} labelled phases: the run did not finish")
    sums: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    counts: collections.Counter = collections.Counter()
    for (copy_name, phase), path in zip(labels, dumps):
        sums[copy_name, phase].update(parse_dump(path))
        counts[copy_name, phase] += 1
    table: dict[str, dict[str, dict[str, float]]] = {}
    for (copy_name, phase), total in sums.items():
        table.setdefault(copy_name, {})[phase] = {k: v / counts[copy_name, phase] for k, v in total.items()}
    return table


def function_counts(path: str) -> collections.Counter:
    """Instructions by function (self cost) of one dump, from ``callgrind_annotate``."""
    out = subprocess.run(["callgrind_annotate", "--show=Ir", "--threshold=100", "--auto=no", path],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    found: collections.Counter = collections.Counter()
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \(\s*[\d.]+%\)\s+(.*)$", line)
        if m and "PROGRAM TOTALS" not in m.group(2):
            name = re.sub(r"'\d+", "", m.group(2)).split(" [")[0]  # (recursion depth, the object file)
            name = re.sub(r"^.*/Python-[\d.]+/", "", name)
            # each copy's generated kernels have names of their own: compared as one
            name = re.sub(r"^.*/inductor/.*\.cpp:(\w+)$", r"inductor's generated code: \1", name)
            found[name] += int(m.group(1).replace(",", ""))
    return found


def function_differences(labels: list[list[str]], dumps: list[str], top: int) -> dict[str, list]:
    """Per phase: the ``top`` functions whose mean instructions a step differ most, gradwatch minus the floor."""
    by: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    steps: collections.Counter = collections.Counter()
    for (copy_name, phase), path in zip(labels, dumps):
        if copy_name in ("gradwatch", "floor"):
            by[copy_name, phase].update(function_counts(path))
            steps[copy_name, phase] += 1
    found = {}
    for phase in PHASES:
        mine, floor = by["gradwatch", phase], by["floor", phase]
        n_mine, n_floor = max(steps["gradwatch", phase], 1), max(steps["floor", phase], 1)
        diff = {k: mine[k] / n_mine - floor[k] / n_floor for k in set(mine) | set(floor)}
        found[phase] = [(k, round(v), round(mine[k] / n_mine)) for k, v in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]]
    return found


# ---------------------------------------------------------------- the child, under valgrind


def _contenders(compiled: bool, flush_every: int, judged: bool = False, regional: bool = False) -> list:
    from benchmarks import contenders as C
    from benchmarks.compiled_floor import CompiledContractReadFloor, CompiledJudgedReadFloor
    from benchmarks.regional_floor import RegionalJudgedReadFloor

    if compiled:
        floor = RegionalJudgedReadFloor if regional else CompiledJudgedReadFloor if judged else CompiledContractReadFloor
        return [C.compiled(C.Unmonitored, "none"), C.compiled(C.gradwatch_contender(flush_every), "gradwatch"),
                C.flushing_every(floor, flush_every)]  # fmt: skip
    if judged:  # (the judged floors read host memory: the CPU's)
        return [C.Unmonitored, C.gradwatch_contender(flush_every), C.flushing_every(C.JudgedReadFloor, flush_every)]
    return [C.Unmonitored, C.gradwatch_contender(flush_every), C.flushing_every(C.ContractReadFloor, flush_every)]


def _workload(name: str, batch: int):
    from benchmarks.workloads import BY_NAME

    if name not in BY_NAME:
        raise SystemExit(f"--workload {name!r}: choose one of {', '.join(BY_NAME)}")
    return BY_NAME[name](batch=batch)


def _phase_counter(copies: list, labels: list[list[str]]) -> None:
    """Each copy's ``after_backward`` closes the forward+backward phase's count and opens its own
    (gradwatch's ``step()``, the floor's read), while the copy is being counted."""
    import torch

    def wrap(contender, name):
        inner = contender.after_backward

        def after_backward():
            if contender.counting:
                torch._C._valgrind_toggle_and_dump_stats()  # forward+backward ends
                labels.append([name, PHASES[0]])
                torch._C._valgrind_toggle()
            inner()
            if contender.counting:
                torch._C._valgrind_toggle_and_dump_stats()
                labels.append([name, PHASES[1]])
                torch._C._valgrind_toggle()

        contender.after_backward = after_backward

    for contender, name in zip(copies, COPIES):
        contender.counting = False
        wrap(contender, name)


def run_child(args: argparse.Namespace) -> None:
    """Warm the copies up uninstrumented, then count ``args.steps`` unsampled steps of each, phase by phase."""
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.cpp.march = "haswell"  # AVX2 (see the module docstring)
    torch.set_num_threads(1)  # a second intra-op thread's spinning would count, differently each run
    from benchmarks.harness import share_one_batch, steady_allocator
    from gradwatch.capture.layout import planned_slots
    from gradwatch.settings import DETAILS

    steady_allocator()
    workload = _workload(args.workload, args.batch)
    torch.manual_seed(0)
    base = workload.make_model()
    kinds = _contenders(args.compiled, args.flush_every, getattr(args, "judged", False), getattr(args, "regional", False))
    copies = [kind(copy.deepcopy(base), workload, torch.device("cpu")) for kind in kinds]
    share_one_batch(copies)  # (the same values: the optimizer's sqrt takes a path of its own for some)
    for _ in range(args.warmup):  # (compiles on the first)
        for contender in copies:
            contender.step()
    for contender in copies:
        contender.prime()  # (gradwatch's and the floor's flush: each starts a fresh window)
    sampled = planned_slots(args.flush_every, DETAILS["standard"])
    quiet = [s for s in range(args.flush_every) if not sampled[s] and s != args.flush_every - 1]
    counted = quiet[2 : 2 + args.steps]  # (not the window's first unsampled steps: the flush's wake)
    labels: list[list[str]] = []
    _phase_counter(copies, labels)
    if os.environ.get(_CHILD):  # (outside valgrind the toggles are no-ops: a smoke test runs this natively)
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
    gc.collect()
    gc.disable()
    for slot in range(max(counted) + 1):
        for contender, name in zip(copies, COPIES):
            contender.counting = slot in counted
            if contender.counting:
                torch._C._valgrind_toggle()
            contender.step()
            if contender.counting:
                torch._C._valgrind_toggle_and_dump_stats()  # the optimizer's step ends
                labels.append([name, PHASES[2]])
                contender.counting = False
    gc.enable()
    for contender in copies:
        contender.close()
    with open(args.manifest, "w") as f:
        json.dump({"labels": labels, "counted_slots": counted}, f)


# ---------------------------------------------------------------- the parent


def _valgrind_command(args: argparse.Namespace, out_file: str, manifest: str) -> list[str]:
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--callgrind-out-file={out_file}"]  # fmt: skip
    if args.cache_sim:
        command += ["--cache-sim=yes", "--branch-sim=yes", f"--LL={args.ll_bytes},16,64"]
    child = [sys.executable, os.path.abspath(__file__), "--manifest", manifest, "--workload", args.workload,
             "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
             "--flush-every", str(args.flush_every)] + (["--compiled"] if args.compiled else [])  # fmt: skip
    child += ["--judged"] if args.judged else []
    child += ["--regional"] if args.regional else []
    return command + child


def report(table: dict, events: list[str]) -> list[str]:
    """The table's lines: each phase's mean counts per copy, then gradwatch minus the floor and the floor minus none."""
    lines = [f"{'phase':18s} {'copy':10s} " + " ".join(f"{e:>12s}" for e in events)]
    for phase in PHASES + ("whole step",):
        rows = {name: _phase_or_whole(table[name], phase) for name in COPIES}
        for name in COPIES:
            lines.append(f"{phase:18s} {name:10s} " + " ".join(f"{rows[name].get(e, 0):12,.0f}" for e in events))
        for upper, lower in (("gradwatch", "floor"), ("floor", "none")):
            lines.append(f"{phase:18s} {upper[:4]}-{lower[:5]:5s} "
                         + " ".join(f"{rows[upper].get(e, 0) - rows[lower].get(e, 0):+12,.0f}" for e in events))  # fmt: skip
    return lines


def _phase_or_whole(phases: dict[str, dict[str, float]], phase: str) -> dict[str, float]:
    if phase != "whole step":
        return phases.get(phase, {})
    whole: collections.Counter = collections.Counter()
    for counts in phases.values():
        whole.update(counts)
    return dict(whole)


def run_parent(args: argparse.Namespace) -> dict:
    for tool in ("valgrind", "callgrind_control", "callgrind_annotate"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: install valgrind (Debian: apt-get install valgrind)")
    work = tempfile.mkdtemp(prefix="gradwatch-instructions-")
    out_file, manifest = os.path.join(work, "callgrind.out"), os.path.join(work, "manifest.json")
    env = dict(os.environ, **AVX2_ENV, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"), **{_CHILD: "1"})
    try:
        run = subprocess.run(_valgrind_command(args, out_file, manifest), env=env, capture_output=True, text=True)
        if run.returncode != 0 or not os.path.exists(manifest):
            tail = "\n".join((run.stdout + run.stderr).splitlines()[-25:])
            raise SystemExit(f"the run under valgrind failed (exit {run.returncode}):\n{tail}")
        with open(manifest) as f:
            made = json.load(f)
        dumps = dumps_in_order(out_file)
        table = per_phase(made["labels"], dumps)
        events = list(parse_dump(dumps[0]))
        figures = {"workload": args.workload, "batch": args.batch, "compiled": args.compiled,
                   "counted_slots": made["counted_slots"], "per_step": table}  # fmt: skip
        print(f"# {args.workload} batch {args.batch}{', compiled' if args.compiled else ''}: instructions and events "
              f"a step, mean over {len(made['counted_slots'])} unsampled steps of each copy (slots {made['counted_slots']})")  # fmt: skip
        print("\n".join(report(table, events)))
        if args.functions:
            figures["functions"] = function_differences(made["labels"], dumps, args.functions)
            for phase, rows in figures["functions"].items():
                print(f"\n## {phase}: gradwatch - floor, instructions a step by function (gradwatch's own)")
                for name, diff, mine in rows:
                    print(f"{diff:+10,d} {mine:11,d}  {name[:140]}")
        return figures
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="mlp", help="mlp (8x512), cnn or transformer (4 layers), as the other scripts name them")
    parser.add_argument("--batch", type=int, default=16, help="small: GEMMs run ~500x slower under valgrind")
    parser.add_argument("--compiled", action="store_true", help="every copy through torch.compile (inductor)")
    parser.add_argument("--judged", action="store_true",
                        help="the floor judged at every step (contenders.JudgedReadFloor; compiled: "
                             "compiled_floor.CompiledJudgedReadFloor)")
    parser.add_argument("--regional", action="store_true",
                        help="with --compiled: the judged floor with per-layer tensors, the form equal blocks compiled "
                             "one by one need to share a graph (regional_floor.RegionalJudgedReadFloor)")
    parser.add_argument("--steps", type=int, default=4, help="unsampled steps counted per copy")
    parser.add_argument("--warmup", type=int, default=10,
                        help="steps of each copy before the flush that starts the window (at least 8: Python 3.11 "
                             "quickens a function at about its 8th call, ~6 K instructions a step of step()'s "
                             "functions counted when the counted steps were their 7th to 10th)")
    parser.add_argument("--flush-every", type=int, default=50)
    parser.add_argument("--functions", type=int, default=0, help="list the K functions that differ most, per phase")
    parser.add_argument("--cache-sim", action="store_true", help="also simulated cache misses and branch mispredictions")
    parser.add_argument("--ll-bytes", type=int, default=4 << 20, help="the simulated last level's size (one core's L2 here)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--manifest", help=argparse.SUPPRESS)  # (the child's: where it lists its dumps)
    args = parser.parse_args()
    if args.regional and not args.compiled:
        parser.error("--regional is a compiled floor: add --compiled")
    if os.environ.get(_CHILD):
        run_child(args)
        return
    figures = run_parent(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
