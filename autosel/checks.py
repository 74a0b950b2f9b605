"""Correctness before speed: a candidate's outputs against the reference's, with dtype-aware tolerances."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from autosel.errors import TuningError
from autosel.formatting import shape_text
from autosel.spec import OpDefinition
from autosel.timing import synchronize

# (rtol, atol) per dtype name. bf16 keeps 8 bits of mantissa and fp16 11, so a kernel that reorders a
# reduction legitimately differs in the last bits; fp32 differences come from reordering alone.
TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-2),
    "bfloat16": (2e-2, 2e-2),
}
# A complex output is compared by its real and imaginary parts, each with its part's tolerances.
COMPLEX_PARTS = {"complex32": "float16", "complex64": "float32", "complex128": "float64"}


@dataclass(frozen=True)
class CheckOutcome:
    ok: bool
    max_abs_err: float | None
    max_rel_err: float | None
    reason: str | None = None


def returns_an_argument(result: Any, args: Sequence[Any]) -> bool:
    """Whether `result` (a tensor, or a tuple or list of them) is only arguments of the call: the in-place idiom
    x.mul_(w), which returns the x it wrote. Same memory seen the same way, not equal values, makes one an argument."""
    import torch

    def alias(r, a) -> bool:
        return r is a or (r.layout == a.layout == torch.strided and r.data_ptr() == a.data_ptr()
                          and r.dtype == a.dtype and r.shape == a.shape and r.stride() == a.stride())

    returned = result if isinstance(result, (tuple, list)) else (result,)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(returned) and all(isinstance(r, torch.Tensor) and any(alias(r, a) for a in tensors)
                                  for r in returned)


def describe(value: Any) -> str:
    """A value as a reason names it: a tensor by its dtype and shape, anything else by its repr, cut short."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} {list(value.shape)} tensor"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def outputs_of(result: Any, args: Sequence[Any]) -> tuple:
    """What to compare: the returned tensor(s), or for an in-place op (returns None) its tensor arguments."""
    import torch

    if result is None:
        return tuple(a for a in args if isinstance(a, torch.Tensor))
    if isinstance(result, (tuple, list)):
        return tuple(result)
    return (result,)


def side_effects(before: Sequence[Any], after: Sequence[Any], reference_after: Sequence[Any]
                 ) -> tuple[list[int], list[int]]:
    """For an op that returns its result: (the tensor arguments the reference left as they were and the candidate
    changed, the ones the reference wrote), by position; all three began as copies of one input. The first must
    be empty; the second are compared with the reference's values like outputs. Byte for byte, so a NaN left in
    place counts as unchanged."""
    import torch

    def as_bytes(t):
        return t.resolve_conj().resolve_neg().reshape(-1).contiguous().view(torch.uint8)

    def same(a, b) -> bool:
        if a.layout != torch.strided or a.is_quantized or a.is_nested:  # no bytes to read: the values, NaN = NaN
            return a.shape == b.shape and bool(torch.equal(a, b))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a), as_bytes(b))

    tensors = [i for i, x in enumerate(before) if isinstance(x, torch.Tensor)]
    written = [i for i in tensors if not same(before[i], reference_after[i])]
    return [i for i in tensors if i not in written and not same(before[i], after[i])], written


def clone_args(args: Sequence[Any]) -> tuple:
    import torch

    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def rotating_copies(args: Sequence[Any], min_bytes: int, *, most: int = 256) -> list[tuple]:
    """Copies of `args` that together hold at least `min_bytes` of tensor data (at least one, at most `most`)."""
    import torch

    size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    count = min(most, max(1, -(-min_bytes // size))) if size else 1
    return [clone_args(args) for _ in range(count)]


def rotating_call(fn: Callable[..., Any], args: Sequence[Any], min_bytes: int) -> Callable[[], Any]:
    """fn called on the next of its own copies of args (rotating_copies: enough to fill min_bytes) at each call."""
    copies = itertools.cycle(rotating_copies(args, min_bytes))
    return lambda: fn(*next(copies))


def tolerances(dtype: Any, rtol: float | None = None, atol: float | None = None) -> tuple[float, float]:
    name = str(dtype).removeprefix("torch.")
    name = COMPLEX_PARTS.get(name, name)
    default_rtol, default_atol = TOLERANCES.get(name, (0.0, 0.0))  # integers and bools compare exactly
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def compare(actual: Sequence[Any], expected: Sequence[Any], *, rtol: float | None = None,
            atol: float | None = None, names: Sequence[str] | None = None) -> CheckOutcome:
    """Every output must match the reference's. A tensor: same shape and dtype, finite, and |a - e| <= atol +
    rtol * |e| everywhere (a complex one part by part); a tuple or list: element by element; anything else (None,
    an int, a float): equal. names: what each output is, for the reason (default "output N")."""
    if len(actual) != len(expected):
        return CheckOutcome(False, None, None, f"returned {len(actual)} outputs, reference returned {len(expected)}")
    worst = [0.0, 0.0]  # max abs, max rel error over the tensors compared so far
    for index, (a, e) in enumerate(zip(actual, expected)):
        where = names[index] if names else f"output {index}" if len(expected) > 1 else "output"
        reason, measured = _difference(a, e, where, rtol, atol, worst)
        if reason is not None:
            return CheckOutcome(False, *(worst if measured else (None, None)), reason)
    return CheckOutcome(True, *worst)


def _difference(a: Any, e: Any, where: str, rtol: float | None, atol: float | None, worst: list[float]
                ) -> tuple[str | None, bool]:
    """Why the candidate's `a` is not the reference's `e` (None if it is), and whether errors were measured
    (into `worst`) before the difference was found."""
    import torch

    if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
        return f"{where} is {describe(a)}, reference is {describe(e)}", False
    if isinstance(e, torch.Tensor):
        return _tensor_difference(a, e, where, rtol, atol, worst)
    if isinstance(a, (tuple, list)) and isinstance(e, (tuple, list)):
        if len(a) != len(e):
            return f"{where} has {len(a)} elements, reference has {len(e)}", False
        for index, (x, y) in enumerate(zip(a, e)):
            reason, measured = _difference(x, y, f"{where}[{index}]", rtol, atol, worst)
            if reason is not None:
                return reason, measured
        return None, False
    try:
        same = bool(a == e)
    except Exception:  # an == that returns no truth value (an array, say) is no match
        same = False
    return (None, False) if same else (f"{where} is {describe(a)}, reference is {describe(e)}", False)


def _tensor_difference(a: Any, e: Any, where: str, rtol: float | None, atol: float | None, worst: list[float]
                       ) -> tuple[str | None, bool]:
    import torch

    if a.shape != e.shape or a.dtype != e.dtype:
        return f"{where} is {a.dtype} {list(a.shape)}, reference is {e.dtype} {list(e.shape)}", False

    def real64(t):  # .double() of a complex tensor would drop its imaginary part (with only a warning)
        t = t.detach()
        return (torch.view_as_real(t.resolve_conj()) if t.is_complex() else t).double()

    # float64 on the outputs' own device: copying a 16384 x 28672 output to the host cost about a second
    # per check on the H200, most of a tune's time.
    a64, e64 = real64(a), real64(e)
    if not torch.isfinite(a64).all():
        kind = "NaN" if torch.isnan(a64).any() else "Inf"
        return f"{where} contains {kind}", False
    r, t = tolerances(e.dtype, rtol, atol)
    diff = (a64 - e64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / e64.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
    worst[:] = max(worst[0], max_abs), max(worst[1], max_rel)
    excess = diff - (t + r * e64.abs())
    if diff.numel() and float(excess.max()) > 0:
        at = int(excess.argmax())
        index = f"{at // 2}, {'imaginary' if at % 2 else 'real'} part" if a.is_complex() else f"{at}"
        return (f"{where} differs from the reference: max abs error {max_abs:.3g} "
                f"(at flat index {index}: {float(a64.flatten()[at]):.4g} vs {float(e64.flatten()[at]):.4g}) "
                f"> atol {t:g} + rtol {r:g} x |reference|"), True
    return None, False


# --- the check of one candidate on every shape, before anything is timed --------------------------------------

@dataclass
class CheckReport:
    errors: dict[int, tuple[float | None, float | None]]  # shape index -> (max abs, max rel) error
    first_call_s: dict[int, float]  # includes compilation on the first shape
    reason: str | None = None  # why it failed, or None
    unsupported: dict[int, str] = field(default_factory=dict)  # shape index -> why a planned op's backend cannot run it


def check_candidate(fn: Callable[..., Any], definition: OpDefinition, reference: Callable[..., Any],
                    shapes: Sequence[dict], *, device: str, seed: int = 0) -> CheckReport:
    """Run `fn` and the reference on the same fresh random inputs of every shape; stop at the first failure."""
    import torch

    report = CheckReport({}, {})
    for index, shape in enumerate(shapes):
        torch.manual_seed(seed + index)
        args = _inputs(definition, shape, device)
        unsupported = getattr(fn, "unsupported", None)  # a Planner: ineligible at this shape, with its reason
        if unsupported is not None and (reason := unsupported(args[0])) is not None:
            report.unsupported[index] = f"does not support {shape_text(shape)}: {reason}"
            continue
        ref_args, call_args = clone_args(args), clone_args(args)
        try:
            ref_result = reference(*ref_args)
        except Exception as exc:  # no candidate can be judged: the op's error, not a candidate's
            raise TuningError(f"op {definition.op!r}: its reference raised {type(exc).__name__}: {exc} at "
                              f"{shape_text(shape)}; fix the reference (the op's torch backend, or register_op's "
                              "reference=) or the shape") from exc
        expected = outputs_of(ref_result, ref_args)
        began = time.perf_counter()
        try:
            result = fn(*call_args)
            synchronize(device)
        except (Exception, SystemExit) as exc:  # sys.exit in a kernel must not end the caller
            report.reason = f"raised {type(exc).__name__}: {exc} at {shape_text(shape)}"
            return report
        report.first_call_s[index] = time.perf_counter() - began
        # In place: its arguments are what it computes, whatever a candidate returns (x.add_(y) too); a candidate
        # returning None matches a reference that returns the argument it wrote (x.mul_(w) returns x).
        in_place = ref_result is None or (result is None and returns_an_argument(ref_result, ref_args))
        if in_place:
            expected, got, names = outputs_of(None, ref_args), outputs_of(None, call_args), [
                f"argument {i} after the call" for i, a in enumerate(call_args) if isinstance(a, torch.Tensor)]
        elif result is None:
            report.errors[index] = (None, None)
            report.reason = (f"returned None where the reference returned {describe(ref_result)} at "
                             f"{shape_text(shape)}")
            return report
        else:
            got, names = outputs_of(result, call_args), None
        outcome = compare(got, expected, rtol=definition.rtol, atol=definition.atol, names=names)
        report.errors[index] = (outcome.max_abs_err, outcome.max_rel_err)
        if not outcome.ok:
            report.reason = f"{outcome.reason} at {shape_text(shape)}"
            return report
        if not in_place:  # an in-place op's written arguments are its outputs, compared above
            report.reason = _side_effect_failure(definition, args, call_args, ref_args, shape)
            if report.reason:
                return report
    return report


def _side_effect_failure(definition: OpDefinition, args, call_args, ref_args, shape: dict) -> str | None:
    """Why a candidate's effect on its arguments differs from the reference's, or None: it changed one the
    reference leaves alone (a result written over an input, say), or left one the reference writes wrong."""
    changed, written = side_effects(args, call_args, ref_args)
    if changed:
        return (f"changed its input argument {', '.join(map(str, changed))}, which the reference leaves as it is, "
                f"at {shape_text(shape)}")
    if not written:
        return None
    outcome = compare(tuple(call_args[i] for i in written), tuple(ref_args[i] for i in written),
                             rtol=definition.rtol, atol=definition.atol)
    if not outcome.ok:
        return (f"its input argument {', '.join(map(str, written))}, which the reference writes, after the call: "
                f"{outcome.reason} at {shape_text(shape)}")
    return None


def _inputs(definition: OpDefinition, shape: dict, device: str) -> tuple:
    """make_inputs for one shape; its failure (a shape from a file without a key the factory reads) is a
    TuningError naming the op and the shape. The check builds every shape first, so timing needs no such guard."""
    try:
        args = definition.make_inputs(dict(shape), device)
    except Exception as exc:
        if isinstance(exc, KeyError) and exc.args and exc.args[0] not in shape:
            advice = (f"the shape has no key {exc.args[0]!r}, which the op's input factory reads; give each shape "
                      "the keys of the op's declared shapes")
        else:
            advice = "fix the shape or the op's make_inputs"
        lines = str(exc).splitlines() or [""]  # one line of it: the CLI's error is one line (torch lists overloads)
        raise TuningError(f"op {definition.op!r}: its make_inputs raised {type(exc).__name__}: "
                          f"{lines[0]}{' [...]' if len(lines) > 1 else ''} for the shape "
                          f"{shape_text(shape)}: {advice}") from exc
    if not isinstance(args, (tuple, list)):  # a bare tensor was unpacked into its rows, and the reference blamed
        raise TuningError(f"op {definition.op!r}: its make_inputs returned a {type(args).__name__} for the shape "
                          f"{shape_text(shape)}; it must return the positional arguments of one call as a tuple, "
                          "such as (x, weight, 1e-6), or (x,) for one")
    return tuple(args)
