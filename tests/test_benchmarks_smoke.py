"""The benchmark code still runs and its contenders do what their names say (no timing here)."""

from __future__ import annotations

import collections
import json

import pytest
import torch

from benchmarks import breakdown as B
from benchmarks import contenders as C
from benchmarks import workloads as W
from benchmarks.harness import balanced_orders, creation_order_for, format_table, host_syncs_between_flushes, measure

_TINY = W.mlp(depth=2, width=16, batch=8)
_CPU = torch.device("cpu")


class _Ticks:
    """A clock that reads 0, 1, 2, ... : a timed step lasts exactly one tick whatever the machine."""

    def __init__(self) -> None:
        self.now = -1.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_every_contender_steps_is_timed_in_balanced_orders_and_reported():
    kinds = C.standard() + [B.WithoutParamStats, B.WithoutOutputGradReductions]
    synced = []  # gpu_check.py passes torch.cuda.synchronize here
    stepped: list[str] = []
    for kind in kinds:  # record the order in which contenders step
        original = kind.step
        kind.step = lambda self, original=original: (stepped.append(self.name), original(self))[1]
    try:
        results = measure(_TINY, kinds, rounds=2, warmup=1, device=_CPU, sync=lambda: synced.append(1),
                          clock=_Ticks())  # fmt: skip
    finally:
        for kind in kinds:
            del kind.step
    n = len(kinds)
    assert len(synced) == 2 * 2 * n  # before and after every timed step
    assert [r.name for r in results] == [k.name for k in kinds]
    assert all(r.times == [1.0, 1.0] for r in results)  # each timed step spans exactly its two clock reads
    names = [k.name for k in kinds]
    timed = stepped[n:]  # after one warm-up step each
    orders = balanced_orders(n)
    assert timed == [names[i] for i in orders[0] + orders[1]]  # the first two orders of the design
    table = format_table(_TINY.name, results)
    assert all(r.name in table for r in results) and "1.000 [1.000, 1.000]" in table


def test_model_copies_are_made_in_the_creation_order_asked_and_reported_as_listed():
    # Where a copy's memory lies follows when it was made (RESULTS, thirty-ninth session): measure()
    # makes them in creation_order, reports them in the listed order, and names a bad order.
    made: list[str] = []

    def kind(name: str) -> type[C.Contender]:
        def init(self, model, workload, device):
            made.append(name)
            C.Contender.__init__(self, model, workload, device)

        return type(name, (C.Contender,), {"name": name, "__init__": init})

    kinds = [kind("a"), kind("b"), kind("c")]
    results = measure(_TINY, kinds, rounds=1, warmup=0, device=_CPU, clock=_Ticks(), creation_order=[2, 0, 1])
    assert made == ["c", "a", "b"] and [r.name for r in results] == ["a", "b", "c"]
    with pytest.raises(ValueError, match=r"creation_order \[0, 0, 1\]"):
        measure(_TINY, kinds, rounds=1, warmup=0, device=_CPU, creation_order=[0, 0, 1])
    assert creation_order_for(3, None) is None
    drawn = [creation_order_for(8, seed) for seed in range(6)]
    assert all(sorted(order) == list(range(8)) for order in drawn) and len({tuple(o) for o in drawn}) > 1
    assert creation_order_for(8, 4) == drawn[4]  # one seed, one order


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8])
def test_balanced_orders_put_each_contender_right_after_every_other_equally_often(n):
    # Counted independently: adjacent pairs within each order, and places.
    orders = balanced_orders(n)
    assert all(sorted(order) == list(range(n)) for order in orders)
    follows = collections.Counter((a, b) for order in orders for a, b in zip(order, order[1:]))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(follows.values())) <= 1  # every ordered pair equally often (once, or twice for odd n)
    places = collections.Counter((c, i) for order in orders for i, c in enumerate(order))
    assert len(places) == n * n and len(set(places.values())) == 1  # every contender at every place equally often


def _stepped(kind):
    torch.manual_seed(0)
    contender = kind(_TINY.make_model(), _TINY, _CPU)
    contender.step()
    return contender


def test_ablations_switch_off_what_they_name_and_nothing_else():
    full = _stepped(C.gradwatch_contender(50))
    no_params = _stepped(B.WithoutParamStats)
    no_out = _stepped(B.WithoutOutputGradReductions)
    rec = {name: c.monitor._recorder for name, c in [("full", full), ("params", no_params), ("out", no_out)]}
    present = {name: r.buffer.host["param_present"][0] for name, r in rec.items()}
    calls = {name: r.buffer["out_grad"][0, 1] for name, r in rec.items()}  # output-gradient calls at step 0
    assert present["full"].all() and calls["full"].all()
    assert not present["params"].any() and calls["params"].all()
    assert present["out"].all() and not calls["out"].any()
    for c in (full, no_params, no_out):
        c.close()


def test_read_once_floor_hooks_every_parametrised_layer_and_cleans_up():
    floor = _stepped(C.ReadOnceFloor)
    parametrised = [m for m in floor.model.modules() if any(True for _ in m.parameters(recurse=False))]
    assert len(floor.handles) == len(parametrised) == 3
    floor.close()
    assert all(not m._forward_hooks for m in floor.model.modules())


def test_benchmark_no_sync_check_counts_the_same_as_an_unmonitored_loop():
    plain, watched = host_syncs_between_flushes(_TINY, _CPU, steps=3)
    assert plain == watched


def test_in_context_costs_reports_each_call():
    costs = B.in_context_costs(_TINY, steps=6, clock=_Ticks())
    assert set(costs) == {"empty hook body", "out.register_hook", "out.sum()"}
    assert all(v == 1e6 for v in costs.values())  # one tick per call, in microseconds


def test_cold_call_costs_times_the_read_and_both_rounds_of_small_calls():
    costs = B.cold_call_costs(_TINY, steps=6, clock=_Ticks())
    assert list(costs) == ["gradient read (_foreach_norm)", "stack", "square into float64", "numpy sum",
                           "stack, again", "square, again", "numpy sum, again"]  # fmt: skip
    assert all(v == 1e6 for v in costs.values())


def test_detection_benchmark_scores_a_pathology_and_a_healthy_run():
    from benchmarks import detection as D

    by_name = {s.name: s for s in D.scenarios()}
    fault = D.run(by_name["1e6x loss spike"])
    assert fault.detected and fault.layer_ok and fault.latency == 0  # returned by the step() of step 80 itself
    healthy = D.run(by_name["MLP, Adam"])
    assert healthy.alerts == []


def test_step_host_times_only_unsampled_non_flush_steps_and_the_floor_read():
    from benchmarks import step_host as S

    figures = {depth: S.measure_depth(depth, steps=60, batch=4, clock=_Ticks()) for depth in (1, 2)}
    for depth, f in figures.items():
        assert f["layers"] == 2 * depth + 1
        # steps 10-59: the flush (49) and at least the second window's first two steps (sampled) left out
        assert 0 < f["counted_steps"] <= 47
        assert f["step_us"] == f["floor_us"] == 1e6 and f["above_floor_per_layer_us"] == 0
    assert S.slopes(figures) == {"1->2": 0.0}


def test_step_host_compiled_times_the_forward_of_both_compiled_copies():
    from benchmarks import step_host as S

    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # process-wide: a delta
    f = S.measure_depth(1, steps=60, batch=4, clock=_Ticks(), compiled=True, backend="aot_eager")
    assert f["layers"] == 3 and 0 < f["counted_steps"] <= 47
    assert f["fwd_us"] == f["floor_fwd_us"] == f["step_us"] == f["floor_us"] == 1e6
    assert f["fwd_above_floor_per_layer_us"] == 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2  # one graph per copy


def test_compiled_contenders_each_keep_their_own_compiled_entries():
    """Two models compiled in one process share dynamo's cache list (one wrapper code object), so a
    call first checks the guards of the other model's entry; ``compile_alone`` gives each its own."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    # of different shapes: two identical models would pass each other's guards and share one entry
    models = [torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.ReLU()) for width in (4, 3)]
    x = torch.randn(2, 4)
    shared = [torch.compile(m, backend="eager") for m in models]
    alone = [C.compile_alone(m, backend="eager") for m in models]
    for compiled, model in zip(shared + alone, models + models):
        assert torch.equal(compiled(x), model(x))
    # torch.compile(module): dynamo runs the module through one wrapper function whose code is the same
    shared_codes = [c.forward._torchdynamo_orig_callable.__code__ for c in shared]
    alone_codes = [c._torchdynamo_orig_callable.__code__ for c in alone]
    assert shared_codes[0] is shared_codes[1]
    assert len(_debug_get_cache_entry_list(shared_codes[0])) == 2
    assert alone_codes[0] is not alone_codes[1]
    assert [len(_debug_get_cache_entry_list(code)) for code in alone_codes] == [1, 1]
    torch._dynamo.reset()


def test_gpu_check_quick_runs_every_part_on_the_cpu_and_keeps_the_figures(tmp_path):
    from benchmarks import gpu_check as G

    path = tmp_path / "gpu_check.json"
    report = G.main(["--quick", "--device", "cpu", "--tiny", "--rounds", "4", "--json", str(path)])
    written = json.loads(path.read_text())
    assert set(written["seconds"]) == {"no_sync", "aten_ops_per_step", "device_work_per_step", "launch_bound", "flush",
                                       "eager", "compiled"}  # fmt: skip
    assert not [name for name, part in written.items() if isinstance(part, dict) and "error" in part]
    assert all(result.startswith("ok") for result in written["no_sync"].values()) and written["no_sync"]
    ops = written["aten_ops_per_step"]["mlp2x16"]
    assert ops["full"] > ops["standard"] > ops["unmonitored"] > 0
    assert written["launch_bound"]["layers"] == 3 and written["launch_bound"]["step_host_us"] > 0
    work = written["device_work_per_step"]["mlp2x16"]  # on the CPU: aten ops of the accelerators' path
    assert work["unit"] == "aten ops" and work["layers"] == 3
    assert work["unsampled"]["extra"] == 3 + 3  # the forward check per layer and three fixed ops
    assert work["sampled"]["extra"] > work["unsampled"]["extra"]
    assert set(written["eager"]["mlp2x16"]) == {k.name for k in G.QUICK_CONTENDERS}
    assert report["launch_bound"]["layers"] == 3
    assert written["flush"]["layers"] == 3 and written["flush"]["ms"]["whole flush"] > 0


def test_gpu_check_keeps_the_figures_of_the_parts_before_one_that_fails(tmp_path):
    from benchmarks import gpu_check as G

    path = tmp_path / "out.json"

    def broken():
        raise RuntimeError("no such kernel")

    report: dict = {}
    G.run_parts([("first", lambda: {"x": 1}), ("second", broken), ("third", lambda: 3)], report, str(path))
    written = json.loads(path.read_text())
    assert written["first"] == {"x": 1} and written["third"] == 3
    assert written["second"] == {"error": "RuntimeError: no such kernel"}
    assert list(written["seconds"]) == ["first", "second", "third"]


def test_step_parts_times_each_part_of_an_unsampled_step_inside_it():
    from benchmarks import step_parts
    from gradwatch.capture import reductions

    before = (reductions.foreach_norm, reductions._CpuSlots.__dict__["settle"])
    us = step_parts.measure(_TINY, steps=40, flush_every=10)
    assert (reductions.foreach_norm, reductions._CpuSlots.__dict__["settle"]) == before  # put back
    assert {"pipeline.step", "  record_step", "  per-step judgement (calm case: from the host check)",
            "      read and settled", "        foreach_norm (small tensors)"} <= set(us)
    assert all(value > 0 for value in us.values())
    # nested parts are inside their owner's time
    assert us["pipeline.step"] >= us["  record_step"] >= us["    parameter gradients"] >= us["      read and settled"]
    assert us["      read and settled"] >= us["        foreach_norm (small tensors)"]


def test_step_ab_imports_another_revision_beside_this_one_and_pairs_their_steps(tmp_path):
    import gradwatch
    from benchmarks import step_ab

    old = step_ab.import_revision("HEAD", str(tmp_path))
    assert old.__name__ == "gradwatch_old" and old.GradMonitor is not gradwatch.GradMonitor
    figures = step_ab.measure(_TINY, old, steps=12, flush_every=5, warmup=2)
    for kind in ("unsampled", "sampled or flush"):
        assert figures[f"{kind}: steps"] > 0
        for who in ("new", "old", "floor"):
            assert figures[f"{kind}: {who}"] > 0
    (tmp_path / "none").mkdir()
    with pytest.raises(RuntimeError, match="no-such-revision.*pass a revision"):
        step_ab.import_revision("no-such-revision", str(tmp_path / "none"))


def test_flush_cost_times_every_part_of_the_flush_inside_it():
    from benchmarks import flush_cost

    figures = flush_cost.measure(_TINY, windows=2, flush_every=10)
    ms = figures["ms"]
    assert figures["layers"] == 3
    parts = ("read (copy, reduce, decode)", "health checks", "write (TensorBoard)")
    assert set(parts) | {"whole flush", "flush step()", "unsampled step()", "  ExplodingRule"} <= set(ms)
    assert all(value > 0 for value in ms.values())
    # each flush holds its own read, checks and write, so its median is at least each of theirs
    assert all(ms["whole flush"] >= ms[part] for part in parts)
    assert ms["flush step()"] >= ms["whole flush"]


@pytest.mark.parametrize("cpu_reductions", [True, False], ids=["cpu-reductions", "device-reductions"])
@pytest.mark.parametrize("tiny", [W.transformer(d_model=16, seq=4, batch=2, layers=1), W.mlp(depth=3, width=256, batch=8)],
                         ids=["attention", "large-weights"])  # fmt: skip
def test_contract_read_floor_writes_what_the_default_writes(cpu_reductions, tiny):
    # The contract's read floor (benchmarks/contenders.py) stands for the reads and writes of the
    # contract's default without its bookkeeping: over two windows it writes the same tags, at the same
    # steps, with the same values as gradwatch's default (float32 reductions: to ~1e-5), a
    # MultiheadAttention's out_proj included. Both its max |g| paths: the CPU's and, on CPU tensors,
    # the one gpu_check.py runs on a device; on the CPU's, weights of at least CPU_LARGE elements
    # (the MLP's 65536) take aminmax and the rest one foreach max, each landing on its own layer.
    import copy

    from .conftest import read_scalars

    torch.manual_seed(0)
    base = tiny.make_model()
    floor = C.ContractReadFloor(copy.deepcopy(base), tiny, _CPU, cpu_reductions=cpu_reductions)
    watched = C.gradwatch_contender(50)(copy.deepcopy(base), tiny, _CPU)
    watched.batch = floor.batch
    for _ in range(100):
        floor.step()
        watched.step()
    floor.sink.writer.flush()
    watched.monitor.close()
    ours, theirs = read_scalars(floor.logdir), read_scalars(watched.logdir)
    floor.close()
    watched.close()
    assert set(ours) == set(theirs) - {"gradwatch/global/alerts"}
    if "transformer" in tiny.name:
        assert any("out_proj" in tag and "act_rms" in tag for tag in ours)
    for tag, values in ours.items():
        assert set(values) == set(theirs[tag]), tag
        for step, value in values.items():
            assert value == pytest.approx(theirs[tag][step], rel=1e-4, abs=1e-6), (tag, step)


@pytest.mark.parametrize("compiled", [False, True, "regional"])
def test_the_judged_floor_alarms_on_a_nan_and_on_a_jump_and_stays_quiet_on_a_healthy_run(compiled):
    # The contract's floor with the least per-step judgement (benchmarks/contenders.py): quiet over a
    # healthy stretch, one alarm at the step whose loss is scaled 1000x (its squared norm ~1e6x the
    # recent ones; Adam's update barely changes), and one at the step whose batch holds a NaN. It
    # judges host memory, so it refuses any other device. Compiled (compiled_floor.py; aot_eager, the
    # same graph as inductor's without its compile): the forward sums it judges are the compiled
    # code's outputs, appended by dynamo after each call.
    import dataclasses

    from benchmarks.compiled_floor import CompiledJudgedReadFloor

    scale = [1.0]
    tiny = W.mlp(depth=2, width=16, batch=8)
    scaled = dataclasses.replace(tiny, loss=lambda out, y: scale[0] * torch.nn.functional.cross_entropy(out, y))
    torch.manual_seed(0)
    if compiled == "regional":  # (regional_floor.py: the forward sums in per-layer cells, read on the host)
        from benchmarks.regional_floor import RegionalJudgedReadFloor

        torch._dynamo.reset()
        floor = RegionalJudgedReadFloor(scaled.make_model(), scaled, _CPU, flush_every=10, backend="aot_eager")
    elif compiled:
        import torch._dynamo as dynamo

        dynamo.reset()
        floor = CompiledJudgedReadFloor(scaled.make_model(), scaled, _CPU, flush_every=10, backend="aot_eager")
    else:
        floor = C.JudgedReadFloor(scaled.make_model(), scaled, _CPU, flush_every=10)
    for _ in range(30):
        floor.step()
    assert floor.alarms == 0
    scale[0] = 1e3
    floor.step()
    assert floor.alarms == 1
    scale[0] = 1.0
    x, y = floor.batch
    floor.batch = (x.clone().index_fill_(0, torch.tensor([3]), float("nan")), y)
    floor.step()
    assert floor.alarms == 2
    floor.close()
    with pytest.raises(ValueError, match="CPU"):
        C.JudgedReadFloor(tiny.make_model(), tiny, torch.device("meta"))


def test_the_regional_floor_s_equal_blocks_share_a_graph_where_the_constant_index_floor_makes_one_each():
    # benchmarks/regional_floor.py: the compiled judged floor with gradwatch's form (per-layer tensors),
    # the floor of a model whose equal blocks are compiled one by one (model[i] = torch.compile(block)).
    # Its blocks share the graphs the unmonitored blocks share; the compiled floor's constant layer
    # index makes a graph per block (its forward alone is run: its ops' shared written tensor, saved
    # for the backward of each block, is bumped by the next block's forward). The regional floor's
    # sampled reads go to every layer on the sampled steps only, found by the layer's key.
    from benchmarks.compiled_floor import CompiledContractReadFloor
    from benchmarks.regional_floor import RegionalJudgedReadFloor

    def blocks() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(4)])

    workload = W.Workload("blocks", blocks, lambda device: (torch.randn(4, 16), torch.randint(0, 16, (4,))),
                          torch.nn.functional.cross_entropy)  # fmt: skip
    graphs = {}
    for kind in (C.Unmonitored, RegionalJudgedReadFloor, CompiledContractReadFloor):
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        model = blocks()
        floor = kind(model, workload, _CPU) if kind is C.Unmonitored else kind(model, workload, _CPU, flush_every=10)
        for i in range(len(model)):
            model[i] = torch.compile(model[i], backend="aot_eager")
        floor._run = model  # (the blocks compiled one by one, the model around them not)
        if kind is CompiledContractReadFloor:
            for _ in range(2):
                model(floor.batch[0])
            graphs[kind.__name__] = counters["stats"]["unique_graphs"]
            floor.close()
            continue
        reads: list[tuple[str, int, int]] = []
        for read in ("output", "out_grad") if kind is RegionalJudgedReadFloor else ():
            method = getattr(floor, f"read_sampled_{read}")
            setattr(floor, f"read_sampled_{read}",
                    lambda layer, t, read=read, method=method: (reads.append((read, floor.slot, layer)), method(layer, t)))
        for _ in range(12):
            floor.step()
        graphs[kind.__name__] = counters["stats"]["unique_graphs"]
        if kind is RegionalJudgedReadFloor:
            sampled = [t % 10 for t in range(12) if floor.sampled[t % 10]]
            assert sorted(reads) == sorted((read, t, i) for read in ("output", "out_grad") for t in sampled
                                           for i in range(4))  # fmt: skip
            assert floor.alarms == 0
        floor.close()
    # (unmonitored: a graph for the first block, whose input needs no gradient, and one the others share)
    assert graphs["RegionalJudgedReadFloor"] == graphs["Unmonitored"] == 2, graphs
    assert graphs["CompiledContractReadFloor"] >= len(blocks()), graphs  # (a graph a block at least)
    torch._dynamo.reset()


def test_the_compiled_contract_floor_reads_on_sampled_steps_only_what_the_eager_floor_reads_in_one_graph():
    # The contract's read floor compiled (benchmarks/compiled_floor.py): its sampled reads go through
    # gated opaque ops, so the model compiles to one graph with no break, the ops read on the planned
    # sampled steps only (each layer's output and output gradient once a sampled step), and it writes
    # the tags, steps and values of the eager floor, which the test above holds to gradwatch's default
    # (aot_eager: the same ops and graph as inductor's, without inductor's ~20 s compile).
    import copy

    import torch._dynamo

    from benchmarks.compiled_floor import CompiledContractReadFloor

    from .conftest import read_scalars

    tiny = W.mlp(depth=3, width=32, batch=8)
    torch.manual_seed(0)
    base = tiny.make_model()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager = C.ContractReadFloor(copy.deepcopy(base), tiny, _CPU)
    compiled = CompiledContractReadFloor(copy.deepcopy(base), tiny, _CPU, backend="aot_eager")
    compiled.batch = eager.batch
    reads: list[tuple[str, int, int]] = []
    for kind in ("output", "out_grad"):
        method = getattr(compiled, f"read_sampled_{kind}")
        setattr(compiled, f"read_sampled_{kind}",
                lambda layer, t, kind=kind, method=method: (reads.append((kind, compiled.slot, layer)), method(layer, t)))
    for _ in range(60):  # a window of 50 and part of the next
        eager.step()
        compiled.step()
    eager.sink.writer.flush()
    compiled.sink.writer.flush()
    ours, theirs = read_scalars(compiled.logdir), read_scalars(eager.logdir)
    eager.close()
    compiled.close()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    layers = len(compiled.names)
    sampled = [t for t in range(60) if compiled.sampled[t % 50]]
    assert len(sampled) >= 2
    assert sorted(reads) == sorted((kind, t % 50, i) for kind in ("output", "out_grad") for t in sampled
                                   for i in range(layers))  # fmt: skip
    assert set(ours) == set(theirs) and any("act_rms" in tag for tag in ours)
    for tag, values in theirs.items():
        assert set(ours[tag]) == set(values), tag
        for step, value in values.items():
            assert ours[tag][step] == pytest.approx(value, rel=1e-5, abs=1e-7), (tag, step)
    torch._dynamo.reset()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="glibc's mallopt")
def test_the_steady_allocator_serves_large_blocks_from_the_heap_and_keeps_what_is_freed():
    # harness.steady_allocator, in a process of its own (it changes the process's allocator), judged
    # by glibc's own accounting (mallinfo2): after it, blocks of 1, 4 and 16 MiB (with glibc's
    # defaults, mappings of their own once above its dynamic threshold) come from the heap, and
    # freeing them hands nothing back to the system.
    import subprocess
    import sys

    script = """
import ctypes, ctypes.util
from benchmarks.harness import steady_allocator

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Info, ctypes.c_void_p, [ctypes.c_void_p]
def mapped_and_heap(size):
    before = libc.mallinfo2()
    block = libc.malloc(size)
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    return during.hblks - before.hblks, during.arena, after.arena
assert mapped_and_heap(40 << 20)[0] == 1  # above any threshold glibc allows: a mapping (what is counted)
assert steady_allocator()
for size in (1 << 20, 4 << 20, 16 << 20):
    mapped, during, after = mapped_and_heap(size)
    assert mapped == 0 and after == during, (size, mapped, during, after)  # from the heap, kept when freed
print("ok")
"""
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_window_gap_is_the_mean_over_whole_windows_of_the_difference_in_points():
    # Three windows of four rounds (and two rounds that make no whole window, left out). The second
    # window's flush round costs the watched contender 2.0 more: worked out by hand, the gaps are
    # (0.4 - 0.2) / 4 = 5, (2.4 - 0.2) / 4 = 55 and 5 points; mean 21.67.
    from benchmarks.harness import Result, window_gap

    base = Result("none", [1.0] * 14)
    floor = Result("floor", [1.05] * 14)
    watched = Result("watched", [1.1] * 14)
    watched.times[7] += 2.0
    mean, low, high, windows = window_gap(base, watched, floor, window=4)
    assert windows == 3
    assert mean == pytest.approx((5 + 55 + 5) / 3)
    assert low == pytest.approx(5.0) and high == pytest.approx(55.0)  # resampled means lie between the extremes
    # a contender against itself: zero, exactly
    assert window_gap(base, floor, floor, window=4)[:3] == (0.0, 0.0, 0.0)


def test_steady_section_windows_every_contender_as_it_says_and_reports_each_gap():
    # The section's contenders were fixed at windows of 50 steps whatever its flush_every: a report
    # over windows of 4 would have set gradwatch's and the floors' flushes 50 steps apart. Now every
    # contender that flushes does so on the section's windows, eager and compiled; and the section
    # runs end to end on a clock of ticks (every step one tick: every gap and part exactly zero).
    from benchmarks import overhead as O

    for compiled in (False, True):
        made = [kind(_TINY.make_model(), _TINY, _CPU) for kind in O.steady_contenders(4, compiled)]
        try:
            windows = {c.name: (c.monitor.flush_every if hasattr(c, "monitor") else c.flush_every)
                       for c in made if hasattr(c, "monitor") or hasattr(c, "flush_every")}  # fmt: skip
        finally:
            for c in made:
                c.close()
        assert len(windows) == 4 and set(windows.values()) == {4}, windows
    figures = O.steady_section(1, _CPU, flush_every=4, candidates=[_TINY], clock=_Ticks())[_TINY.name]
    gaps = [k for k in figures if "above" in k]
    assert len(gaps) == 5 and all(figures[k][:3] == (0.0, 0.0, 0.0) and figures[k][3] == 1 for k in gaps)
    parts = [k for k in figures if k.startswith("parts of ")]
    assert len(parts) == 5 and all(v == (0.0, 0.0) for k in parts for v in figures[k].values())
    assert all(figures[c.name]["mean_ratio"] == 1.0 for c in O.steady_contenders(4)[1:])
    # on an accelerator, without the judged floors (they judge host memory and refuse other devices)
    for compiled in (False, True):
        on_cpu, elsewhere = (O.steady_contenders(4, compiled, torch.device(d)) for d in ("cpu", "cuda"))
        judged = [k for k in on_cpu if issubclass(k, C.JudgedReadFloor)]  # (compiled: and with per-layer tensors)
        assert len(judged) == (2 if compiled else 1) and [k.name for k in elsewhere] == [k.name for k in on_cpu if k not in judged]


def _callgrind_dump(path, events: list[str], values: list[int]) -> None:
    """A file as callgrind writes a dump: its events and their totals (the lines the script reads)."""
    path.write_text("# callgrind format\nversion: 1\ncreator: callgrind-3.19.0\n"
                    f"events: {' '.join(events)}\nfn=(1) main\n0 {' '.join(map(str, values))}\n"
                    f"summary: {' '.join(map(str, values))}\ntotals: {' '.join(map(str, values))}\n")  # fmt: skip


def test_instruction_counts_are_averaged_per_copy_and_phase_in_the_order_the_dumps_were_made(tmp_path):
    from benchmarks import instructions as I

    # two counted steps of each copy, three phases each: 18 dumps, numbered past 9 (10 sorts after 9)
    labels, values, expected = [], {}, collections.defaultdict(list)
    for step in range(2):
        for copy_index, copy_name in enumerate(I.COPIES):
            for phase_index, phase in enumerate(I.PHASES):
                n = len(labels) + 1
                ir, dr = 1000 * (copy_index + 1) + 100 * phase_index + step, 7 * n
                _callgrind_dump(tmp_path / f"callgrind.out.{n}", ["Ir", "Dr"], [ir, dr])
                labels.append([copy_name, phase])
                values[n] = (ir, dr)
                expected[copy_name, phase].append((ir, dr))
    (tmp_path / "callgrind.out").write_text("events: Ir Dr\nsummary: 0 0\n")  # the run's end: not a step
    dumps = I.dumps_in_order(str(tmp_path / "callgrind.out"))
    assert [int(p.rsplit(".", 1)[1]) for p in dumps] == list(range(1, 19))
    table = I.per_phase(labels, dumps)
    for (copy_name, phase), rows in expected.items():
        assert table[copy_name][phase] == {"Ir": sum(r[0] for r in rows) / 2, "Dr": sum(r[1] for r in rows) / 2}
    lines = I.report(table, ["Ir", "Dr"])
    # gradwatch minus the floor over the whole step: the three phases' means summed, per copy
    whole = {c: sum(sum(r[0] for r in expected[c, p]) / 2 for p in I.PHASES) for c in I.COPIES}
    assert any(line.startswith("whole step") and f"{whole['gradwatch'] - whole['floor']:+12,.0f}" in line
               for line in lines)  # fmt: skip
    with pytest.raises(ValueError, match="did not finish"):
        I.per_phase(labels[:-1], dumps)
    (tmp_path / "empty.1").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no summary line"):
        I.parse_dump(str(tmp_path / "empty.1"))


@pytest.mark.parametrize("judged", [False, True])
def test_instructions_child_counts_each_copy_s_unsampled_steps_phase_by_phase(tmp_path, monkeypatch, judged):
    """Run natively, where callgrind's toggles are no-ops: the labels the parent pairs with the dumps."""
    import argparse

    from benchmarks import instructions as I
    from gradwatch.capture.layout import planned_slots
    from gradwatch.settings import DETAILS

    monkeypatch.delenv(I._CHILD, raising=False)
    manifest = tmp_path / "manifest.json"
    args = argparse.Namespace(workload="mlp", batch=2, compiled=False, steps=2, warmup=1, flush_every=8,
                              manifest=str(manifest), judged=judged)  # fmt: skip
    floors = []  # the floor the child made: the judged one where asked
    made_floor = C.JudgedReadFloor.after_backward if judged else C.ContractReadFloor.after_backward
    monkeypatch.setattr(C.JudgedReadFloor if judged else C.ContractReadFloor, "after_backward",
                        lambda self: (floors.append(type(self)), made_floor(self))[1])  # fmt: skip
    threads = torch.get_num_threads()
    try:
        I.run_child(args)
    finally:
        torch.set_num_threads(threads)
    made = json.loads(manifest.read_text())
    sampled = planned_slots(8, DETAILS["standard"])
    assert made["counted_slots"] and all(not sampled[s] and s != 7 for s in made["counted_slots"])
    expected = [[c, p] for _ in made["counted_slots"] for c in I.COPIES for p in I.PHASES]
    assert made["labels"] == expected
    assert floors and all(issubclass(kind, C.JudgedReadFloor) == judged for kind in floors)


def test_every_contender_steps_on_one_batch():
    # Each copy drew a batch of its own, so the copies' Adam states and the optimizer's work differed
    # (MKL's sqrt takes a slower path for some values: one copy's optimizer step counted 0.4 M
    # instructions above another's, benchmarks/RESULTS.md forty-fourth session); measure() and
    # instructions.py now hand every copy the first one's.
    from benchmarks.harness import share_one_batch

    made = [C.Unmonitored(_TINY.make_model(), _TINY, _CPU) for _ in range(3)]
    assert not torch.equal(made[0].batch[0], made[1].batch[0])  # drawn one after another: different
    share_one_batch(made)
    assert all(c.batch is made[0].batch for c in made)
