"""FSDP1 (``FullyShardedDataParallel``, ``use_orig_params=True`` and ``False``) and DeepSpeed ZeRO on gloo: every statistic of the whole
model, under every sharding strategy that runs on CPU, against an unsharded twin trained on every
rank's batch and against FSDP's own unsharded gradients and weights (``summon_full_params``).
Workers: tests/distributed/fsdp1_worker.py."""

from __future__ import annotations

import math

import pytest

from gradwatch.capture.updates import NOT_ON_FLAT_PARAMETERS

pytestmark = pytest.mark.distributed

fsdp = pytest.importorskip("torch.distributed.fsdp")

# CPU offload of parameters needs pinned memory, which torch refuses without an accelerator:
# "Cannot access accelerator device when none is available" (FlatParamHandle.init_flat_param_attributes).
#: the worker's model: Linear(8, 16), Linear(16, 16), Linear(16, 3), weights and biases
_WHOLE = (8 * 16 + 16) + (16 * 16 + 16) + (16 * 3 + 3)
TWO_RANKS = ("FULL_SHARD", "FULL_SHARD+nested", "SHARD_GRAD_OP+nested", "NO_SHARD", "FULL_SHARD+bf16")
#: use_orig_params=False: one flat parameter per unit, read per original parameter
TWO_RANKS_FLAT = ("FULL_SHARD+flat", "SHARD_GRAD_OP+nested+flat", "NO_SHARD+flat", "FULL_SHARD+nested+bf16+flat")


def _check(results: list[dict]) -> None:
    for index in range(len(results[0]["runs"])):
        runs = [r["runs"][index] for r in results]
        config = runs[0]["config"]
        for rank, run in enumerate(runs):
            assert run["layers"] == ["0", "2", "4"], (config, run["layers"])  # no _fsdp_wrapped_module
            assert run["alerts"] == [], (config, run["alerts"])
            # no collective between flushes; the attach agreement, then one per reduction kind at the flush
            assert run["calls_before_flush"] == {"gather": 1, "reduce": 0, "partials": 0}, config
            assert run["calls"] == {"gather": 1, "reduce": 2, "partials": 0}, config
            for t, (got, expected) in enumerate(zip(run["got"], run["expected"])):
                flat = "flat" in config  # use_orig_params=False: the optimizer steps flat parameters
                measured = ("grad_norm", "grad_max") if flat else ("grad_norm", "grad_max", "update_ratio")
                for name, values in got.items():
                    if not flat:  # FSDP's own unsharded gradient and weights: exact under every strategy and precision
                        for stat in measured:
                            assert values[stat] == pytest.approx(expected[name]["fsdp"][stat], rel=1e-6), (config, rank, t, name, stat)
                    else:
                        assert math.isnan(values["update_ratio"]), (config, name)
                    # the float32 twin on every rank's batch; under bf16 (its forward differs) the flat
                    # layout has no other reference: within the bf16 forward's error
                    tolerance = 1e-5 if "bf16" not in config else 3e-2 if flat else None
                    for stat in measured if tolerance else ():
                        assert values[stat] == pytest.approx(expected[name][stat], rel=tolerance), (config, rank, t, name, stat)
                    assert values["nonfinite"] == 0.0
                    # out_grad_norm: root-sum-square over the ranks of each rank's own output gradient (as DDP)
                    own = math.sqrt(sum(r["expected"][t][name]["local_out_sq"] for r in runs))
                    assert values["out_grad_norm"] == pytest.approx(own, rel=1e-9), (config, name)
            # dead units: zero output gradient for every sample on every rank
            for name, fraction in run["dead"].items():
                alive = [any(unit) for unit in zip(*[r["alive"][name] for r in runs])]
                assert fraction == pytest.approx(1 - sum(alive) / len(alive)), (config, name)
            assert run["dead"]["0"] == pytest.approx(5 / 16)
        if "NO_SHARD" not in config:  # the test means something: each rank holds pieces, not layers
            assert sum(math.prod(shape) for shape in runs[0]["local_shapes"]) < _WHOLE, runs[0]["local_shapes"]


def test_fsdp1_every_strategy_on_two_ranks_gives_the_whole_models_statistics(gloo):
    _check(gloo("tests.distributed.fsdp1_worker:body", 2, *TWO_RANKS))


def test_fsdp1_hybrid_sharding_on_four_ranks_counts_each_piece_once(gloo):
    # shard over pairs of ranks, replicate across the pairs: summing every rank's piece would count each twice
    _check(gloo("tests.distributed.fsdp1_worker:body", 4, "HYBRID_SHARD+nested", "HYBRID_SHARD+nested+flat"))


def test_fsdp1_without_original_parameters_reads_each_parameter_in_the_flat_gradient(gloo):
    # use_orig_params=False: the modules hold no parameters; each unit's FlatParameter holds this
    # rank's shard of all of them. gradwatch reads each original parameter's slice of it.
    results = gloo("tests.distributed.fsdp1_worker:body", 2, *TWO_RANKS_FLAT)
    _check(results)
    for run in (run for result in results for run in result["runs"]):
        assert any("update_ratio is not measured under FSDP1 with use_orig_params=False" in m
                   for m in run["warnings"]), run["warnings"]  # fmt: skip
        handed_over = [m for m in run["warnings"] if m.startswith("set_optimizer: ")]
        assert handed_over == ["set_optimizer: " + NOT_ON_FLAT_PARAMETERS], handed_over
    for run in results[0]["runs"]:  # histograms=True: rank 0's slices of the flat gradients
        if run["histograms"] is not None:  # None: bf16, where the float32 twin is no reference
            _check_histograms(run["histograms"], rel=1e-5, at_least=2, where=run["config"])


def _check_histograms(histograms: dict, rel: float, at_least: int, where: str) -> None:
    """Rank 0's histograms against the gradient elements the worker read itself: (count, min, max)
    each; a layer none of whose elements the rank holds has none; at least ``at_least`` drawn."""
    drawn = [name for name, (written, _) in histograms.items() if written is not None]
    assert len(drawn) >= at_least, (where, histograms)
    for name, (written, expected) in histograms.items():
        assert (written is None) == (expected is None), (where, name, written, expected)
        if written is not None:
            assert written[0] == expected[0], (where, name)
            assert written[1:] == pytest.approx(expected[1:], rel=rel), (where, name)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_deepspeed_zero_1_2_and_3_give_the_whole_gradient(gloo, world):
    # deepspeed (0.19.8, constraints.txt; in the test extras on Linux) with its CPU accelerator. Every
    # p.grad is None after engine.backward; gradwatch reads each rank's fragment of ZeRO's reduced
    # gradient (no collective until the flush). On 4 ranks ZeRO 3 splits every tensor four ways and
    # pads the 15- and 3-element ones (the 2-rank run pads only the odd ones).
    pytest.importorskip("deepspeed")
    for rank, result in enumerate(gloo("tests.distributed.deepspeed_worker:body", world)):
        for stage in ("1", "2", "3"):
            run = result[stage]
            assert run["layers"] == ["0", "2", "scale", "4"] and run["alerts"] == []
            assert run["units"] == {"0": 16, "2": 15, "scale": 15, "4": 3}  # whole shapes, also under ZeRO 3
            assert run["calls_before_flush"] == {"gather": 1, "reduce": 0, "partials": 0}
            assert run["calls"] == {"gather": 1, "reduce": 2, "partials": 0}
            for record in run["steps"]:
                assert record["grads_none"]  # what makes ZeRO unreadable through p.grad
                assert 0 < record["held"] < record["total"]  # each rank holds a fragment, not the whole
                for name, values in record["got"].items():
                    for stat, value in values.items():
                        assert value == pytest.approx(record["expected"][name][stat], rel=1e-6), (stage, name, stat)
            if rank == 0:  # histograms=True: rank 0's own fragments (p.grad is None); ZeRO 1/2
                # partition one flat buffer, so rank 0's part may hold a single layer
                _check_histograms(run["histograms"], rel=1e-6, at_least=1, where=stage)
        message = result["before_initialize"]  # ZeRO 3's partitioned parameters, no optimizer yet
        assert message is not None and message.startswith("UnsupportedSharding"), message
        assert "ZeRO stage 3" in message and "deepspeed.initialize" in message
