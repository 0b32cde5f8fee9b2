"""The generated detection corpus (benchmarks/corpus.py): its peer rules, and a smoke subset run here.

The full corpus (hundreds of runs) is a benchmark, reported in benchmarks/RESULTS.md; the
subset runs every fault kind on two model families and three healthy recipes each.
"""

from __future__ import annotations

import math

import pytest

from benchmarks import corpus
from gradwatch import HealthConfig


def test_peer_rules_alarm_where_their_definitions_say():
    flat = [1.0 + 0.01 * (t % 3) for t in range(60)]  # a calm series: mean ~1.01, std ~0.008
    loss = flat[:40] + [50.0] + flat[41:50] + [math.nan] + flat[51:]
    norm = flat[:45] + [1.5] + flat[46:]  # +0.5: 60 std above the mean, 1.5x its level
    alarms = corpus.peer_alarms(loss, norm)
    assert alarms["nonfinite loss"] == [50]
    assert alarms["Megatron 10x"] == [40]  # 50 > 10 x the running maximum 1.02
    assert alarms["OLMo 6 std"] == [40, 45]  # the loss spike and the norm spike
    assert 45 in alarms["ZClip 2.5"] and all(t >= 25 for t in alarms["ZClip 2.5"])  # after its warm-up


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mlp", "cnn"])  # two tests: the suite's workers take one each
def test_the_smoke_subset_finds_every_fault_with_its_kind_and_layer_and_stays_silent_on_healthy_runs(family):
    outcomes = corpus.main(["--quick", "--family", family])
    faulty = [o for o in outcomes if o.kind]
    healthy = [o for o in outcomes if o.kind is None]
    assert {o.kind for o in faulty} == set(corpus.KINDS) and len(healthy) == 3
    assert all(o.real for o in outcomes), [(o.run, o.why_not_real) for o in outcomes if not o.real]
    for o in faulty:  # the ground truth is the benchmark's own measurement, not gradwatch's
        assert o.detected and o.layer_ok, (o.run, o.layer, o.expected_layers, o.alerts)
        if "persistent scaler skips" in o.run:  # found at the 25th skipped step in a row, by definition
            assert o.latency == HealthConfig().scaler_skips_max - 1, (o.run, o.latency)
        elif o.kind in ("nonfinite", "exploding"):
            assert o.latency <= 2, (o.run, o.latency)
        assert o.alerts_before_fault == 0, (o.run, o.alerts)
    assert all(o.alerts == [] for o in healthy), [(o.run, o.alerts) for o in healthy]
