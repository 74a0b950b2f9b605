"""What a batch tune plans and what it returns, as values: a TuneJob for each (op, mode) to time, a TuneOutcome
for each (op, mode) asked about; tuning plans and runs them, autosel.parallel carries them to worker processes."""

from __future__ import annotations

from dataclasses import dataclass

from autosel.decisions import Decision
from autosel.spec import KernelSpec, OpDefinition


@dataclass(frozen=True)
class TuneOutcome:
    """One (op, mode) of a batch tune: a fresh decision, a stored one reused, or why there is none.
    buckets: the per-bucket decisions beside it (empty for an op without a bucket function).
    platform_key: the platform it was decided for (several with tune_ops(devices=...) on a host whose GPUs differ).
    device: with devices=..., the GPU whose worker tuned it ("cuda:1"); "" otherwise."""

    op: str
    mode: str
    status: str  # "tuned", "stored", "copied" (from a shipped layer), "failed"
    decision: Decision | None = None
    detail: str = ""
    buckets: tuple[Decision, ...] = ()
    platform_key: str = ""
    device: str = ""


@dataclass(frozen=True)
class TuneJob:
    """One (op, mode) that plan_jobs found undecided on `platform_key`: everything a tune of it needs, as values
    that pickle (module-level callables only), so a worker process (autosel.parallel) can run it."""

    op: str
    mode: str
    platform_key: str
    definition: OpDefinition
    eligible: tuple[KernelSpec, ...]
    shapes: tuple[dict, ...]  # timed: the given ones, else the representative ones
    reference: KernelSpec | None  # the backend checked against; None: definition.reference is a callable
    check_shapes: tuple[dict, ...] = ()  # the op's representative shapes: checked (with `shapes`), timed only as those
