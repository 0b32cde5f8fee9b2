"""Several real processes (gloo, CPU): layouts, reductions over the mesh, failures that must not hang.

Each test starts its workers with the ``gloo`` fixture (``tests/conftest.py``); values are compared
with what the workers computed themselves from retained gradients or
``full_tensor()``, never with gradwatch's own arithmetic.
"""

from __future__ import annotations

import math

import pytest


pytestmark = pytest.mark.distributed

fsdp = pytest.importorskip("torch.distributed.fsdp")
needs_fully_shard = pytest.mark.skipif(not hasattr(fsdp, "fully_shard"), reason="this torch has no FSDP2 fully_shard")

LAYERS = ("gate", "a", "b", "expert", "head")


def test_conditional_compute_and_different_call_orders_across_ranks(gloo):
    ranks = gloo("tests.distributed.conditional_worker:body", 2)  # both processes finish
    for window_index in range(2):
        for rank in ranks:
            w = rank["windows"][window_index]
            for name in LAYERS:
                # out_grad_norm: root-sum-square over both ranks of the retained output gradients
                expected = [
                    math.sqrt(sum(r["steps"][s][name] for r in ranks)) for s in w["steps"]
                ]
                assert w["out_grad_norm"][name] == pytest.approx(expected, rel=1e-6), (rank, name)
                # dead_fraction: units whose output gradient was zero for every sample on both ranks
                masks = [r["windows"][window_index]["alive"][name] for r in ranks]
                masks = [m for m in masks if m is not None]
                alive = [any(unit) for unit in zip(*masks)]
                assert w["dead_fraction"][name] == pytest.approx(1 - sum(alive) / len(alive)), (rank, name)
    gate = ranks[0]["windows"][0]["dead_fraction"]["gate"]
    assert gate == 0.25  # 2 of 8 units dead on both ranks; rank 0 alone would say 0.5
    assert ranks[1]["windows"][0]["out_grad_norm"]["expert"][0] > 0  # rank 1 never ran it, yet sees it
    assert all(r["sync_dist"] for r in ranks)


def test_ranks_monitoring_different_layers_agree_on_their_union(gloo):
    # rank 1 excludes expert: both ranks still see every layer, each combined over the ranks holding it
    ranks = gloo("tests.distributed.conditional_worker:body", 2, "subset")
    for r in ranks:
        assert not r["warnings"], r["warnings"]
        w = r["windows"][0]
        assert w["dead_fraction"]["gate"] == 0.25  # combined over both ranks, as in the usual case
        expert = [math.sqrt(ranks[0]["steps"][s]["expert"]) for s in w["steps"]]  # rank 0 alone holds it
        assert w["out_grad_norm"]["expert"] == pytest.approx(expert, rel=1e-6)
        gate = [math.sqrt(sum(q["steps"][s]["gate"] for q in ranks)) for s in w["steps"]]
        assert w["out_grad_norm"]["gate"] == pytest.approx(gate, rel=1e-6)
    # reduction turned off after the first window: each rank its own values, in the same layout
    for r, own_dead in zip(ranks, (0.5, 0.25)):
        w = r["windows"][1]
        assert w["dead_fraction"]["gate"] == own_dead
        gate = [math.sqrt(r["steps"][s]["gate"]) for s in w["steps"]]
        assert w["out_grad_norm"]["gate"] == pytest.approx(gate, rel=1e-6)
    assert all(math.isnan(v) for v in ranks[1]["windows"][1]["out_grad_norm"]["expert"])  # not held by rank 1


def test_the_same_layer_name_with_different_shapes_falls_back_to_local_statistics(gloo):
    ranks = gloo("tests.distributed.conditional_worker:body", 2, "mismatch")
    for r in ranks:
        assert r["sync_dist"] is False
        warning = next(m for m in r["warnings"] if "different units or parameters" in m)
        assert "expert: 6 units" in warning and "5 units" in warning, warning
    # each rank reports its own: rank 0's gate sees only its own 4 dead units of 8
    assert ranks[0]["windows"][0]["dead_fraction"]["gate"] == 0.5


def test_a_failure_on_one_rank_leaves_no_rank_waiting(gloo, gloo_param_path):
    # (on both parameter paths: on the accelerators', the failed step's per-step row is left out too)
    ranks = gloo("tests.distributed.conditional_worker:body", 2, "fail")
    # step 4 failed on rank 1: both ranks drop that step, keep the others and stay in sync
    for r in ranks:
        second = r["windows"][1]
        assert second["steps"] == [3, 4, 5]
        assert math.isnan(second["grad_norm"]["gate"][1])
        assert all(math.isfinite(v) for v in second["grad_norm"]["gate"][::2])
        assert r["sync_dist"] is True
    assert sum("forced failure" in m for m in ranks[1]["warnings"]) == 1


def test_a_failed_collective_is_never_retried_and_reduction_stops_with_one_warning(gloo):
    # the first collective of the first flush raises on every rank (the communicator is broken)
    ranks = gloo("tests.distributed.conditional_worker:body", 2, "collective")
    for r in ranks:
        assert r["sync_dist"] is False
        assert sum("is not retried" in m for m in r["warnings"]) == 1, r["warnings"]
        # exactly one collective was attempted: no retry, and none at the second flush
        assert r["collective_calls"] == 1
        assert r["windows"][0] is None  # a half-reduced window is dropped, not guessed
    # the second window is each rank's own: rank 0's gate sees its own 4 dead units of 8
    assert ranks[0]["windows"][1]["dead_fraction"]["gate"] == 0.5
    assert ranks[1]["windows"][1]["dead_fraction"]["gate"] == 0.25


def test_an_exception_on_one_rank_closes_its_monitor_without_a_collective(gloo):
    # rank 0 raises inside `with GradMonitor(...)`; both ranks then make the user's own all_reduce
    ranks = gloo("tests.distributed.exception_worker:body", 2)
    for r in ranks:
        assert r["user_sum"] == [2.0, 2.0, 2.0]  # ones from both ranks: the user's collective met the other rank's
        assert r["gradwatch_collectives"]["reduce"] == 0


@needs_fully_shard
def test_fsdp2_grad_norm_is_the_norm_of_the_full_unsharded_gradient(gloo):
    for rank, result in enumerate(gloo("tests.distributed.fsdp_worker:body", 2, "flat")):
        for got, exp in zip(result["got"], result["expected"]):
            for name, value in got.items():
                assert value == pytest.approx(exp["full"][name], rel=1e-5), (rank, name)
                # and the test means something: a shard's norm differs from the full one
                assert exp["local"][name] < exp["full"][name] * 0.999
        _check_update_ratio(result)


def _check_update_ratio(result):
    """update_ratio of sharded weights: that of the full tensors (gathered by the worker) around opt.step()."""
    assert result["update_steps"] == [0, 1]
    for got, exp in zip(result["got_ratio"], result["expected"]):
        for name, value in got.items():
            assert value == pytest.approx(exp["update_ratio"][name], rel=1e-3), name


@needs_fully_shard
def test_fsdp2_hybrid_2x2_mesh_counts_each_shard_once(gloo):
    # replicate x shard: summing the shard partials over all four ranks would count each twice
    results = gloo("tests.distributed.fsdp_worker:body", 4, "hsdp")
    for rank, result in enumerate(results):
        assert result["placements"][0] == "(Replicate(), Shard(dim=0))"
        for t, (got, exp) in enumerate(zip(result["got"], result["expected"])):
            for name, value in got.items():
                assert value == pytest.approx(exp["full"][name], rel=1e-5), (rank, name)
                # what summing every rank's shard partial gives: sqrt(2) x the full norm
                naive = math.sqrt(sum(r["expected"][t]["local"][name] ** 2 for r in results))
                assert naive == pytest.approx(math.sqrt(2) * exp["full"][name], rel=1e-5)
        _check_update_ratio(result)


def test_data_parallel_ranks_confirm_dead_units_inside_their_own_window(gloo, gloo_param_path):
    # Every rank sees the dead units on the first sampled steps and records the rest of the window
    # in full: its own flush confirms them (not the next window's), as in a single process. On both
    # parameter paths: the accelerators' keeps each step's norms in per-step rows, copied into the
    # buffer before the flush's collectives (which must not add up DDP's replicated gradients).
    for rank in gloo("tests.distributed.dead_units_worker:body", 2, "agree"):
        assert rank["per_step_rows"] == (gloo_param_path == "device-agnostic")
        first = rank["windows"][0]
        assert all(first["sampled"]) and first["own_dead_fraction"] == 0.75
        assert [(kind, layer, step) for kind, layer, step, _ in rank["alerts"]] == [("dead_units", "0", 24)]
        assert rank["alerts"][0][3] == first["own_dead_fraction"]
        for window in rank["windows"]:
            for name in ("0", "2"):
                own = [step[name] for step in window["own_grad_norm"]]
                assert window["grad_norm"][name] == pytest.approx(own, rel=1e-6), name


def test_ranks_that_disagree_on_a_confirmation_confirm_nothing_until_they_agree(gloo):
    # Rank 0 sees the dead units on its first sampled steps and records the rest of the window in
    # full; rank 1 saw them fire and does not. The reduced window counts a step as sampled only where
    # every rank sampled it (no half-reduced output gradient is reported) and holds rank 1's
    # evidence: the units fired, nothing is dead. The next window both ranks agree, and confirm.
    ranks = gloo("tests.distributed.dead_units_worker:body", 2, "disagree")
    for rank in ranks:
        first, second = rank["windows"]
        assert first["own_dead_fraction"] == first["dead_fraction"] == 0.0
        assert not all(first["sampled"]) and first["sampled"][:2] == [True, True]
        assert all((v is None) != s for v, s in zip(first["out_grad_norm"], first["sampled"])), first
        assert all(second["sampled"]) and second["own_dead_fraction"] == 0.75
        assert [(kind, layer, step) for kind, layer, step, _ in rank["alerts"]] == [("dead_units", "0", 49)]
    assert ranks[0]["windows"] == ranks[1]["windows"]


def test_ranks_that_confirm_different_layers_back_off_alike(gloo):
    # Both ranks record the rest of the first window in full, each to confirm a different gate; the
    # reduced window finds both alive. The back-off must follow what the ranks asked together (the
    # window's record), not each rank's own request, or their schedules and sampled steps drift apart.
    ranks = gloo("tests.distributed.dead_units_worker:crossed", 2)
    assert all(ranks[0]["sampled"][0]) and all(ranks[1]["sampled"][0])
    assert ranks[0]["states"] == ranks[1]["states"]
    cooldown = ranks[0]["states"][0]["dead_cooldown"]
    assert set(cooldown) == {"a", "b"}, cooldown  # both gates were confirmed alive: both wait
