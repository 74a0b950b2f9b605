"""Correctness before speed: a candidate's outputs against the reference's, with dtype-aware tolerances."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

# (rtol, atol) per dtype name. bf16 keeps 8 bits of mantissa and fp16 11, so a kernel that reorders a
# reduction legitimately differs in the last bits; fp32 differences come from reordering alone.
TOLERANCES = {
    "float64": (1e-7, 1e-9),
    "float32": (1e-4, 1e-5),
    "float16": (1e-2, 1e-2),
    "bfloat16": (2e-2, 2e-2),
}


@dataclass(frozen=True)
class CheckOutcome:
    ok: bool
    max_abs_err: float | None
    max_rel_err: float | None
    reason: str | None = None


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
    default_rtol, default_atol = TOLERANCES.get(name, (0.0, 0.0))  # integers and bools compare exactly
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


def compare(actual: Sequence[Any], expected: Sequence[Any], *, rtol: float | None = None,
            atol: float | None = None, names: Sequence[str] | None = None) -> CheckOutcome:
    """Every output must match: same shape and dtype, finite, and |a - e| <= atol + rtol * |e| everywhere.
    names: what each output is, for the reason (default "output N")."""
    import torch

    if len(actual) != len(expected):
        return CheckOutcome(False, None, None, f"returned {len(actual)} outputs, reference returned {len(expected)}")
    worst_abs = worst_rel = 0.0
    for index, (a, e) in enumerate(zip(actual, expected)):
        where = names[index] if names else f"output {index}" if len(expected) > 1 else "output"
        if not isinstance(a, torch.Tensor):
            return CheckOutcome(False, None, None, f"{where} is {type(a).__name__}, not a tensor")
        if a.shape != e.shape or a.dtype != e.dtype:
            return CheckOutcome(False, None, None,
                                f"{where} is {a.dtype} {list(a.shape)}, reference is {e.dtype} {list(e.shape)}")
        # float64 on the outputs' own device: copying a 16384 x 28672 output to the host cost about a second
        # per check on the H200, most of a tune's time.
        a64, e64 = a.detach().double(), e.detach().double()
        if not torch.isfinite(a64).all():
            kind = "NaN" if torch.isnan(a64).any() else "Inf"
            return CheckOutcome(False, None, None, f"{where} contains {kind}")
        r, t = tolerances(e.dtype, rtol, atol)
        diff = (a64 - e64).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        max_rel = float((diff / e64.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
        worst_abs, worst_rel = max(worst_abs, max_abs), max(worst_rel, max_rel)
        excess = diff - (t + r * e64.abs())
        if diff.numel() and float(excess.max()) > 0:
            at = int(excess.argmax())
            return CheckOutcome(
                False, worst_abs, worst_rel,
                f"{where} differs from the reference: max abs error {max_abs:.3g} "
                f"(at flat index {at}: {float(a64.flatten()[at]):.4g} vs {float(e64.flatten()[at]):.4g}) "
                f"> atol {t:g} + rtol {r:g} x |reference|",
            )
    return CheckOutcome(True, worst_abs, worst_rel)
