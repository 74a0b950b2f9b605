"""Correctness checks: dtype-aware tolerances, NaN/Inf never pass, in-place ops compared by their arguments."""

from __future__ import annotations

import pytest
import torch

from autosel.checks import compare, outputs_of, side_effects, tolerances


@pytest.mark.parametrize("dtype, rtol, atol", [
    (torch.float32, 1e-4, 1e-5), (torch.bfloat16, 2e-2, 2e-2), (torch.float16, 1e-2, 1e-2), (torch.int64, 0, 0),
])
def test_default_tolerances(dtype, rtol, atol):
    assert tolerances(dtype) == (rtol, atol)


def test_within_tolerance_passes_and_reports_errors():
    ref = torch.ones(8, dtype=torch.bfloat16)
    outcome = compare((ref + 0.0078125,), (ref,))
    assert outcome.ok and outcome.max_abs_err == pytest.approx(0.0078125)


def test_outside_tolerance_fails_with_the_values():
    ref = torch.zeros(4)
    outcome = compare((torch.tensor([0.0, 0.31, 0.0, 0.0]),), (ref,))
    assert not outcome.ok
    assert outcome.reason.startswith("output differs from the reference: max abs error 0.31 (at flat index 1")


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "Inf")])
def test_non_finite_never_passes(bad, word):
    ref = torch.full((3,), bad)  # even a reference with the same value does not make it pass
    outcome = compare((ref.clone(),), (ref,))
    assert not outcome.ok and word in outcome.reason


def test_shape_and_dtype_mismatch():
    assert "reference is torch.float32 [4]" in compare((torch.zeros(2),), (torch.zeros(4),)).reason
    assert "torch.float16 [4]" in compare((torch.zeros(4, dtype=torch.float16),), (torch.zeros(4),)).reason


def test_in_place_ops_are_compared_by_their_tensor_arguments():
    x, y = torch.zeros(2), torch.ones(2)
    assert outputs_of(None, (x, 3, y)) == (x, y)
    assert outputs_of((x, y), ()) == (x, y)


def test_side_effects_tell_an_argument_the_candidate_changed_from_one_the_reference_writes():
    torch = pytest.importorskip("torch")
    nan = torch.tensor([float("nan"), 1.0])
    before = (torch.ones(4, 4).t(), torch.zeros(()), nan, torch.ones(2, dtype=torch.bfloat16), 3)
    after = (before[0].clone().add_(1), before[1].clone(), nan.clone(), before[3].clone(), 3)  # 0: changed
    reference_after = (before[0].clone(), before[1].clone(), nan.clone(), before[3].clone() * 2, 3)  # 3: written
    assert side_effects(before, after, reference_after) == ([0], [3])  # a NaN left in place is unchanged
    conj = torch.tensor([1 + 2j]).conj()
    assert side_effects((conj,), (conj.clone(),), (conj.clone(),)) == ([], [])


@pytest.mark.parametrize("actual, expected", [
    ((torch.ones(4), None), (torch.ones(4), None)),
    ((torch.ones(4), 8), (torch.ones(4), 8)),
    ((torch.ones(4), 2.5, "rms"), (torch.ones(4), 2.5, "rms")),
    ((torch.ones(4), (None, torch.ones(2))), (torch.ones(4), (None, torch.ones(2)))),
], ids=["none", "int", "float-and-str", "nested"])
def test_outputs_that_are_not_tensors_pass_when_equal(actual, expected):
    # Used to break: every candidate, the reference's own backend too, was told "output 1 is NoneType, not a tensor".
    assert compare(actual, expected).ok


@pytest.mark.parametrize("actual, expected, reason", [
    ((torch.ones(4), 8), (torch.ones(4), 64), "output 1 is 8, reference is 64"),
    ((torch.ones(4), 0), (torch.ones(4), None), "output 1 is 0, reference is None"),
    ((torch.ones(4), torch.ones(4)), (torch.ones(4), None),
     "output 1 is a torch.float32 [4] tensor, reference is None"),
    ((torch.ones(4), None), (torch.ones(4), torch.ones(4)),
     "output 1 is None, reference is a torch.float32 [4] tensor"),
    ((torch.ones(4), (1, 2)), (torch.ones(4), (1, 3)), "output 1[1] is 2, reference is 3"),
    ((torch.ones(4), [1, 2]), (torch.ones(4), [1]), "output 1 has 2 elements, reference has 1"),
], ids=["int", "zero-for-none", "tensor-for-none", "none-for-tensor", "nested", "nested-length"])
def test_outputs_that_are_not_tensors_fail_with_both_sides_named(actual, expected, reason):
    # Used to break: a tensor where the reference returns None raised AttributeError ('NoneType' has no 'shape').
    outcome = compare(actual, expected)
    assert not outcome.ok and outcome.reason == reason


def test_a_complex_output_with_a_wrong_imaginary_part_fails():
    # Used to break: .double() dropped the imaginary part (with only a UserWarning), so this passed.
    ref = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    outcome = compare((ref + torch.tensor([0, 0.5j], dtype=torch.complex64),), (ref,))
    assert not outcome.ok
    assert outcome.reason.startswith("output differs from the reference: max abs error 0.5 (at flat index 1, "
                                     "imaginary part: -3.5 vs -4)")
    assert compare((ref.conj(),), (ref.conj(),)).ok  # a lazily conjugated tensor is read as its values


def test_a_complex_output_that_differs_by_rounding_passes_with_its_parts_tolerances():
    # Used to break: complex dtypes fell through to tolerance (0, 0), so a correct result was rejected.
    assert tolerances(torch.complex64) == tolerances(torch.float32)
    assert tolerances(torch.complex128) == tolerances(torch.float64)
    ref = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    assert compare((ref * (1 + 1e-6),), (ref,)).ok
