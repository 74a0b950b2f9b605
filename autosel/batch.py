"""Batch tuning of many ops, what `autosel tune` runs: plan a job for each contested (op, mode) not decided yet
(plan_jobs), run each here (run_job) or spread over GPUs (autosel.parallel), and say what became of each
(tune_ops). Each job is tuned exactly as a miss at selection is (tuning.tune_and_record)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

from autosel import config, platforms
from autosel.errors import TuningError
from autosel.jobs import TuneJob, TuneOutcome
from autosel.platforms import PlatformInfo
from autosel.registry import registry
from autosel.tuning import (contested_ops, database, decided_on, decision_key, lookup_stored, modes_for,
                            reference_for, reference_spec, representative_shapes, tune_and_record)

log = logging.getLogger(__name__)


def tune_ops(patterns: list[str] | None = None, *, force: bool = False, budget_s: float | None = None,
             shapes: dict[str, list[dict]] | None = None, modes: list[str] | None = None,
             on_event: Callable | None = None, settings: config.Settings | None = None,
             isolate_timeout_s: float | None = None, copy_found: bool = False,
             devices: str | list[int] | None = None) -> list[TuneOutcome]:
    """Tune every contested op (or those matching `patterns`) in every mode; stored decisions are reused.

    shapes: {op: [shape, ...]}: tune those ops on exactly these shapes. A stored decision is reused only when it
    was measured on every one of them, else the op is tuned on them and its stored table (the op-level row and
    every bucket row) replaced by the new one. Its candidates are checked on its representative shapes too, as
    always: the new table's op-level winner runs the buckets these shapes leave out.

    isolate_timeout_s: check each candidate first in a child process killed after this many seconds.
    copy_found: a decision found in a shipped layer is copied into the user layer (status "copied"), with its
    bucket rows, so a DB built for an image (`autosel tune --db build.db`) holds every decision.
    devices: "all" or GPU indices such as [0, 1]: spread the tunes over the GPUs (autosel.parallel: this process
    tunes on the first, a spawned worker process on each other); each kind of GPU among them gets its own decisions. None: tune here, on the current device.
    """
    settings = settings or config.settings()
    db, budget_s = database(settings), budget_s or settings.budget_s
    workers = None
    if devices is None:
        targets = [platforms.current_platform()]
    else:
        from autosel import parallel

        workers = parallel.gpu_workers(devices)
        targets = parallel.kinds(workers)
    planned = [item for platform in targets
               for item in plan_jobs(platform, db, patterns, force=force, shapes=shapes, modes=modes,
                                     copy_found=copy_found)]
    jobs = [item for item in planned if isinstance(item, TuneJob)]
    if workers is None:
        done = [run_job(job, platform=targets[0], db=db, budget_s=budget_s, force=force, on_event=on_event,
                        isolate_timeout_s=isolate_timeout_s) for job in jobs]
    else:
        done = parallel.run_jobs(jobs, workers, run=run_job, open_db=database, settings=settings, budget_s=budget_s,
                                 force=force,
                                 isolate_timeout_s=isolate_timeout_s,
                                 on_event=on_event and (lambda event, worker: on_event(replace(event, device=worker))))
    results = iter(done)
    return [next(results) if isinstance(item, TuneJob) else item for item in planned]


def plan_jobs(platform: PlatformInfo, db, patterns: list[str] | None = None, *, force: bool = False,
              shapes: dict[str, list[dict]] | None = None, modes: list[str] | None = None,
              copy_found: bool = False) -> list[TuneOutcome | TuneJob]:
    """What tune_ops does for each contested op and mode on `platform`, in registration order: an outcome where
    nothing needs timing (a stored decision, copied with copy_found; no shapes; no reference), else a job."""
    planned: list[TuneOutcome | TuneJob] = []
    for op, eligible in contested_ops(platform, patterns):
        definition = registry.definition(op)
        for mode in modes or modes_for(platform):
            key = decision_key(op, eligible, platform, mode)
            given = (shapes or {}).get(op)
            found = None if force else lookup_stored(db, key, eligible)
            if found is not None and given and not decided_on(found[0], given):
                found = None  # decided on other shapes: the caller asked for these to be timed
            if found is not None:
                stored, buckets, layer = found
                copy = copy_found and layer.kind != "user"
                if copy:
                    db.record(stored, buckets)
                status, where = ("copied", "copied from") if copy else ("stored", "stored in")
                covered = "; it was decided on every given shape; --force (force=True) times them again" if given else ""
                # `autosel -v tune` said nothing at all when every decision was stored, as selection's -v does.
                log.info("op %r (%s mode): %s, %s %s%s; not timed again (--force times it)", op, mode, stored.winner,
                         where, layer.path, f" with {len(buckets)} bucket rows" if buckets else "")
                planned.append(TuneOutcome(op, mode, status, stored, f"{where} {layer.path}{covered}", buckets,
                                           platform.key))
                continue
            try:
                representative = representative_shapes(definition, platform) if definition else []
            except TuningError as exc:  # a plug-in's broken shapes function: this op alone fails
                planned.append(TuneOutcome(op, mode, "failed", None, str(exc), platform_key=platform.key))
                continue
            op_shapes = given or representative
            if definition is None or not op_shapes:
                planned.append(TuneOutcome(op, mode, "failed", None, "no representative shapes; declare them with "
                                           "autosel.register_op", platform_key=platform.key))
                continue
            try:
                reference = reference_spec(definition)
            except TuningError as exc:
                planned.append(TuneOutcome(op, mode, "failed", None, str(exc), platform_key=platform.key))
                continue
            planned.append(TuneJob(op, mode, platform.key, definition, tuple(eligible), tuple(op_shapes), reference,
                                   tuple(representative)))
    return planned


def run_job(job: TuneJob, *, platform: PlatformInfo, db, budget_s: float, force: bool = False,
            on_event: Callable | None = None, isolate_timeout_s: float | None = None) -> TuneOutcome:
    """Tune one planned job on this process's device and record it. A TuningError (every candidate rejected, a
    shape the op's factory cannot build) is a "failed" outcome, also sent to on_event as a "failed" TuneEvent so
    that a progress display can close the job; so is any other exception (a plug-in's broken code), logged with
    its traceback, so that one op does not end a batch tune."""
    from autosel.tuner import TuneEvent

    def failed(detail: str) -> TuneOutcome:
        if on_event is not None:
            on_event(TuneEvent("failed", job.op, detail=detail, mode=job.mode))
        return TuneOutcome(job.op, job.mode, "failed", None, detail, platform_key=job.platform_key)

    try:
        reference = reference_for(job.definition, job.reference)
        recorded = tune_and_record(job.definition, list(job.eligible), platform=platform, mode=job.mode, db=db,
                                   budget_s=budget_s, force=force, shapes=list(job.shapes), on_event=on_event,
                                   isolate_timeout_s=isolate_timeout_s, reference=reference,
                                   check_shapes=list(job.check_shapes))
    except TuningError as exc:
        return failed(str(exc))
    except (Exception, SystemExit) as exc:  # a plug-in's broken code (a reference that cannot load): this op alone
        log.exception("tuning %s (%s mode) raised", job.op, job.mode)
        return failed(f"raised {type(exc).__name__}: {exc}")
    if not recorded.tuned:
        return TuneOutcome(job.op, job.mode, "stored", recorded.decision, "recorded by another process while this "
                           "one waited to tune it", recorded.buckets, job.platform_key)
    return TuneOutcome(job.op, job.mode, "tuned", recorded.decision, "", recorded.buckets, job.platform_key)
