"""What one step's host values say (readback.summarize): its fast path for the finite case and
its exact path agree with a direct computation."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from gradwatch.flush.readback import StepValues, summarize

# Three layers; tensors 0-1 belong to layer 0, 2 to layer 1, 3-4 to layer 2.
_LAYOUT = SimpleNamespace(names=["a", "b", "c"], param_layer=np.array([0, 0, 1, 2, 2]))


def _values(sq, present, nonfinite=None, forward=None, out_sq=None) -> StepValues:
    sq = np.asarray(sq, dtype=np.float64)
    return StepValues(
        slot=0, sq=sq, nonfinite=np.zeros_like(sq) if nonfinite is None else np.asarray(nonfinite, dtype=np.float64),
        present=np.asarray(present, dtype=np.int64),
        forward=np.array([1.5, -2.0, 3.0]) if forward is None else np.asarray(forward, dtype=np.float64),
        out_sq=np.zeros(3) if out_sq is None else np.asarray(out_sq, dtype=np.float64), order=None, failed=False,
    )  # fmt: skip


def test_finite_step_gives_the_norm_over_present_tensors_and_no_flag():
    sq = [4.0, 9.0, 1e30, 0.25, 16.0]
    present = [1, 1, 0, 1, 2]  # tensor 2 had no gradient this step (its column is ignored); 2 ranks had tensor 4
    s = summarize(_values(sq, present), _LAYOUT, None)
    expected = math.sqrt(np.sum(np.array(sq)[np.array(present) > 0], dtype=np.float64))
    assert s.global_norm == pytest.approx(expected, rel=1e-15)
    assert s.has_grad and not s.any_bad and not s.fwd_bad.any() and not s.grad_bad.any() and s.count == 0.0


def test_no_gradient_at_all_gives_a_nan_norm():
    s = summarize(_values([0.0] * 5, [0] * 5), _LAYOUT, None)
    assert not s.has_grad and math.isnan(s.global_norm) and not s.any_bad


def test_a_nan_in_an_absent_column_is_ignored_by_the_exact_path():
    s = summarize(_values([1.0, 1.0, math.nan, 1.0, 1.0], [1, 1, 0, 1, 1]), _LAYOUT, None)
    assert s.global_norm == pytest.approx(2.0) and not s.any_bad


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_gradient_flags_its_layer(bad):
    s = summarize(_values([1.0, 1.0, 1.0, bad, 1.0], [1] * 5, nonfinite=[0, 0, 0, 7, 0]), _LAYOUT, None)
    assert s.any_bad and s.grad_bad.tolist() == [False, False, True] and not s.fwd_bad.any() and s.count == 7.0


def test_opposite_infinities_do_not_cancel_into_a_finite_step():
    # +inf and -inf running forward sums: their sum is NaN, not a finite number
    s = summarize(_values([1.0] * 5, [1] * 5, forward=[math.inf, -math.inf, 0.0]), _LAYOUT, None)
    assert s.any_bad and s.fwd_bad.tolist() == [True, True, False]


def test_a_forward_that_was_already_non_finite_is_not_flagged_again():
    previous = np.array([1.0, math.inf, 0.0])
    s = summarize(_values([1.0] * 5, [1] * 5, forward=[1.0, math.inf, math.nan]), _LAYOUT, previous)
    assert s.fwd_bad.tolist() == [False, False, True]


def test_a_non_finite_output_gradient_flags_its_layer():
    s = summarize(_values([1.0] * 5, [1] * 5, out_sq=[0.0, math.inf, 0.0]), _LAYOUT, None)
    assert s.any_bad and s.grad_bad.tolist() == [False, True, False]


def test_finite_values_whose_sum_overflows_flag_nothing():
    # each square is finite; their total overflows: the exact path finds no bad layer
    s = summarize(_values([1e308, 1e308, 1.0, 1.0, 1.0], [1] * 5), _LAYOUT, None)
    assert not s.any_bad and math.isinf(s.global_norm)
