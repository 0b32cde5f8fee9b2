"""Pipeline and tensor parallelism (gloo processes, CPU): rank 0 sees every layer of every rank, exact.

The workers (``tests.parallel_worker``) record references on the ranks that hold each layer,
from ``p.grad`` / ``full_tensor()``, weight copies and their own output-gradient hooks; the
tests combine them across ranks and compare with what rank 0 sent to its metrics callback.
The references themselves are checked against a single-process run of the full model.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from .parallel_worker import (
    FLUSH_EVERY, MICROBATCHES, SEQ, STEPS, References, batch, build_net, build_sp_net, build_tp_net, sp_batch, tp_batch,
)  # fmt: skip

pytestmark = pytest.mark.distributed

pipelining = pytest.importorskip("torch.distributed.pipelining")
fsdp = pytest.importorskip("torch.distributed.fsdp")
needs_fully_shard = pytest.mark.skipif(not hasattr(fsdp, "fully_shard"), reason="this torch has no FSDP2 fully_shard")

PP_LAYERS = ["layers.0", "layers.1", "layers.2", "layers.3"]


def _sent(rank0: dict) -> dict[int, dict[str, float]]:
    """Rank 0's metrics by step (a step's window scalars and its update ratios arrive separately)."""
    by_step: dict[int, dict[str, float]] = {}
    for step, metrics in rank0["sent"]:
        for tag, value in metrics.items():
            assert tag not in by_step.setdefault(step, {}), f"{tag} sent twice for step {step}"
            by_step[step][tag] = value
    return by_step


def _holders(ranks: list[dict], layer: str) -> list[dict]:
    return [r for r in ranks if layer in r["layers"]]


def _check_every_layer(ranks: list[dict], layers: list[str], out_sq_ranks=None, unit_offsets=None) -> None:
    """Rank 0's metrics against the references of the ranks holding each layer.

    ``out_sq_ranks(layer)``: the ranks whose output-gradient sums add up to the layer's (default:
    every holder); ``unit_offsets(rank, layer)``: where a rank's units start in the layer.
    """
    sent = _sent(ranks[0])
    assert sorted(sent) == list(range(STEPS))  # one record per optimizer step
    for step in range(STEPS):
        metrics = sent[step]
        total = 0.0
        for layer in layers:
            holders = _holders(ranks, layer)
            ref = holders[0]["steps"][step]
            for r in holders[1:]:  # data-parallel replicas and tensor-parallel ranks see one full gradient
                assert r["steps"][step]["grad_norm"][layer] == pytest.approx(ref["grad_norm"][layer], rel=1e-6)
            assert metrics[f"gradwatch/grad_norm/{layer}"] == pytest.approx(ref["grad_norm"][layer], rel=1e-5)
            assert metrics[f"gradwatch/grad_max/{layer}"] == pytest.approx(ref["grad_max"][layer], rel=1e-5)
            assert metrics[f"gradwatch/nonfinite/{layer}"] == 0
            contributors = out_sq_ranks(layer) if out_sq_ranks else holders
            out = math.sqrt(sum(r["steps"][step]["out_sq"][layer] for r in contributors))
            assert metrics[f"gradwatch/out_grad_norm/{layer}"] == pytest.approx(out, rel=1e-5), (step, layer)
            if f"gradwatch/update_ratio/{layer}" in metrics:
                assert metrics[f"gradwatch/update_ratio/{layer}"] == pytest.approx(ref["update_ratio"][layer], rel=1e-4)
            total += ref["grad_norm"][layer] ** 2
        assert metrics["gradwatch/global/grad_norm"] == pytest.approx(math.sqrt(total), rel=1e-5)
    measured = {layer for m in sent.values() for layer in layers if f"gradwatch/update_ratio/{layer}" in m}
    assert measured == set(layers)
    for window in range(STEPS // FLUSH_EVERY):
        last = sent[(window + 1) * FLUSH_EVERY - 1]
        for layer in layers:
            units: set[int] = set()
            size = 0
            for r in _holders(ranks, layer):
                mask = r["windows"][window]["alive"][layer]
                offset = unit_offsets(r, layer) if unit_offsets else 0
                size = max(size, offset + len(mask))
                units |= {offset + i for i, alive in enumerate(mask) if alive}
            expected = 1 - len(units) / size
            assert last[f"gradwatch/dead_fraction/{layer}"] == pytest.approx(expected), (window, layer)


def _single_process_pipeline_references(dead: bool = False) -> list[dict]:
    """The full model in one process, micro-batch by micro-batch as the schedule runs it."""
    net = build_net(dead)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    named = {f"layers.{k}": m for k, m in net.layers.items()}
    refs = References(named)
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            nn.functional.mse_loss(net(xc), yc).backward()
        for p in net.parameters():
            p.grad /= MICROBATCHES  # the schedule's scale_grads
        norms = {n: float(torch.cat([p.grad.reshape(-1).double() for p in m.parameters()]).norm()) for n, m in named.items()}
        out.append({"grad_norm": norms, "out_sq": refs.take_step()})
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_two_pipeline_stages_rank0_writes_every_layer_of_every_stage(gloo, schedule):
    _check_two_pipeline_stages(gloo("tests.distributed.parallel_worker:body", 2, schedule))


@pytest.mark.parametrize("gloo_param_path", ["device-agnostic"], indirect=True)
def test_two_pipeline_stages_on_the_accelerators_parameter_path(gloo, gloo_param_path):
    # The stages hold different layers (the union's layout, reduced over the mesh); on the
    # accelerators' path each stage keeps its steps' norms and forward sums in per-step rows,
    # copied into its buffer before the flush reads it. CPU tensors, so that CI runs it.
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "gpipe")
    assert all(r["per_step_rows"] for r in ranks)
    _check_two_pipeline_stages(ranks)


def _check_two_pipeline_stages(ranks: list) -> None:
    single = _single_process_pipeline_references()
    for r in ranks:  # the references are those of the full model in one process
        for step, ref in enumerate(r["steps"]):
            for layer in r["layers"]:
                assert ref["grad_norm"][layer] == pytest.approx(single[step]["grad_norm"][layer], rel=1e-5)
                assert ref["out_sq"][layer] == pytest.approx(single[step]["out_sq"][layer], rel=1e-5)
        assert r["calls"] == {layer: STEPS * MICROBATCHES for layer in r["layers"]}  # static shapes: no extra pass
        assert r["monitor_layers"] == PP_LAYERS and r["sync_dist"] and not r["warnings"], r["warnings"]
        assert r["alerts"] == []
    assert ranks[0]["layers"] == PP_LAYERS[:2] and ranks[1]["layers"] == PP_LAYERS[2:]
    _check_every_layer(ranks, PP_LAYERS)


def test_a_dead_layer_on_the_last_stage_is_alerted_reported_and_named_as_the_root(gloo, tmp_path, capsys):
    from gradwatch.cli import main

    logdir = tmp_path / "tb"
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "dead", str(logdir))
    _check_every_layer(ranks, PP_LAYERS)
    for r in ranks:  # every rank judged the same union, so stop_on would stop them together
        assert [(kind, layer) for kind, layer, _ in r["alerts"]] == [("dead_units", "layers.2")]
    message = ranks[0]["alerts"][0][2]
    assert "layers layers.0 and layers.1 before it" in message  # stage 0's zero gradients follow from it
    assert any("dead_units" in m and "layers.2" in m for m in ranks[0]["warnings"])
    capsys.readouterr()
    assert main(["report", str(logdir)]) == 1
    report = capsys.readouterr().out
    assert "dead_units" in report and "layers.2" in report, report


@needs_fully_shard
def test_pipeline_by_fsdp2_on_a_2x2_mesh_gives_the_full_models_values(gloo):
    ranks = gloo("tests.distributed.parallel_worker:body", 4, "pp_fsdp")
    assert [r["layers"] for r in ranks] == [PP_LAYERS[:2]] * 2 + [PP_LAYERS[2:]] * 2
    for r in ranks:
        assert r["sync_dist"] and not r["warnings"], r["warnings"]
    # out_grad_norm: the root-sum-square over both data-parallel replicas of the stage
    _check_every_layer(ranks, PP_LAYERS)


def _single_process_tp_references() -> list[dict]:
    net = build_tp_net()
    named = {"fc1": net.fc1, "fc2": net.fc2}
    refs = References(named)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    out = []
    for step in range(STEPS):
        net(tp_batch(step)).square().mean().backward()
        norms = {n: float(torch.cat([p.grad.reshape(-1).double() for p in m.parameters()]).norm()) for n, m in named.items()}
        out.append({"grad_norm": norms, "out_sq": refs.take_step()})
        opt.step()
        opt.zero_grad()
        if (step + 1) % FLUSH_EVERY == 0:
            out[-1]["alive"] = refs.take_window()
    return out


def test_tensor_parallel_colwise_and_rowwise_layers_count_their_outputs_once(gloo):
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "tp")
    single = _single_process_tp_references()
    sent = _sent(ranks[0])
    for step in range(STEPS):
        for layer in ("fc1", "fc2"):  # the unsharded model's values
            expected = math.sqrt(single[step]["out_sq"][layer])
            assert sent[step][f"gradwatch/out_grad_norm/{layer}"] == pytest.approx(expected, rel=1e-5)
            assert sent[step][f"gradwatch/grad_norm/{layer}"] == pytest.approx(single[step]["grad_norm"][layer], rel=1e-5)
    assert sent[1]["gradwatch/dead_fraction/fc1"] == pytest.approx(5 / 16)  # units 0-3 and 10, on both ranks' halves
    # fc1's output is split (each rank adds its half); fc2's repeated after its all-reduce (counted once)
    _check_every_layer(
        ranks, ["fc1", "fc2"],
        out_sq_ranks=lambda layer: ranks if layer == "fc1" else ranks[:1],
        unit_offsets=lambda r, layer: 8 * r["tp_rank"] if layer == "fc1" else 0,
    )  # fmt: skip


def test_sequence_parallel_norms_and_token_sharded_outputs_give_the_full_models_values(gloo):
    # The norm under SequenceParallel has Partial gradients and a token-sharded DTensor output; fc2
    # (RowwiseParallel(output_layouts=Shard(1))) hands each rank other tokens: both add up over ranks.
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "sp")
    net = build_sp_net()
    named = {"norm": net.norm, "fc1": net.fc1, "fc2": net.fc2}
    refs = References(named)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    sent = _sent(ranks[0])
    for step in range(STEPS):  # the unsharded model on the whole sequence, in one process
        (net(sp_batch(step)).square().sum() / (4 * SEQ * 8)).backward()
        out_sq = refs.take_step()
        for name, module in named.items():
            norm = float(torch.cat([p.grad.reshape(-1).double() for p in module.parameters()]).norm())
            assert sent[step][f"gradwatch/grad_norm/{name}"] == pytest.approx(norm, rel=1e-5), (step, name)
            assert sent[step][f"gradwatch/out_grad_norm/{name}"] == pytest.approx(math.sqrt(out_sq[name]), rel=1e-5)
        opt.step()
        opt.zero_grad()
    assert sent[1]["gradwatch/dead_fraction/fc1"] == pytest.approx(5 / 16)
    for r in ranks:
        assert r["sync_dist"] and not r["warnings"], r["warnings"]
        # hands off: gradwatch read a private reduced copy of the norm's Partial gradients; every
        # p.grad is the same object with the same (Partial) placement after step(), and training is
        # that of an unmonitored twin, to the bit
        assert all("Partial" in p["weight"] and "Partial" in p["bias"] for p in r["norm_grad_placements"])
        assert r["grad_identity"] == [True] * STEPS
        assert r["twin_gap"] == [0.0] * STEPS


@needs_fully_shard
def test_tensor_parallel_by_fsdp2_on_a_2x2_mesh_gives_the_full_models_values(gloo):
    ranks = gloo("tests.distributed.parallel_worker:body", 4, "tp_dp")
    for r in ranks:
        assert r["sync_dist"] and not r["warnings"], r["warnings"]
    _check_every_layer(
        ranks, ["fc1", "fc2"],
        out_sq_ranks=lambda layer: ranks if layer == "fc1" else [r for r in ranks if r["tp_rank"] == 0],
        unit_offsets=lambda r, layer: 8 * r["tp_rank"] if layer == "fc1" else 0,
    )  # fmt: skip


def test_the_schedules_shape_inference_pass_is_avoided_by_static_stage_shapes(gloo):
    # Without input_args/output_args the schedule runs one forward and backward more at its first
    # step, to infer shapes (on uninitialised inputs after stage 0): forward hooks see it.
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "dynamic")
    for r in ranks:
        assert r["calls"] == {layer: STEPS * MICROBATCHES + 1 for layer in r["layers"]}


def test_sync_off_and_pause_mean_no_collective_under_sequence_parallelism(gloo):
    ranks = gloo("tests.distributed.parallel_worker:body", 2, "sp_quiet")
    for r in ranks:
        # sync_dist=False: 3 steps, no collective; on: one per step (the private Partial reduction);
        # paused: none
        assert r["calls_per_step"] == [0, 0, 0, 1, 1, 0, 0], r
        assert r["off_calls"] == {"gather": 0, "reduce": 0, "partials": 0}
        assert r["on_calls"]["partials"] == 2 and r["on_calls"]["reduce"] == 0
