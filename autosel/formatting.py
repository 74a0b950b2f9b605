"""How numbers, times, shapes and a decision's lead read in words, for logs, errors, the CLI and the report: the one
place each is written, so that every surface says a time or a shape alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autosel.decisions import Decision


def format_us(value: float | None) -> str:
    """A time in microseconds with three significant digits, in s, ms or µs; "-" for none."""
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.3g} s"
    if value >= 1e3:
        return f"{value / 1e3:.3g} ms"
    return f"{value:.3g} µs"


def shape_label(shape: dict) -> str:
    """A shape as its values alone, for a plot's axis: "64×4096"."""
    return "×".join(str(v) for v in shape.values())


def shape_text(shape: dict) -> str:
    """A shape as its keys and values: "tokens=64, hidden=4096"."""
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def format_lead(decision: Decision) -> str:
    """How much slower the runner-up is than the winner; a runner-up that was faster overall is said in words:
    it did not beat the default by more than the noise round after round, so the default was kept."""
    lead = decision.lead_over_runner_up
    if lead is None:
        return "-"
    if lead >= 0:
        return f"{lead:+.1%}"
    return f"default kept: runner-up {-lead:.1%} faster, not beyond the noise in every round"
