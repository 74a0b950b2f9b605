"""Deciding an op: the stored decision from the DB layers, else a tune now under the DB's lease; and batch
tuning of many ops (what `autosel tune` runs)."""

from __future__ import annotations

import fnmatch
import json
import logging
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from autosel import config, platforms
from autosel.decisions import OP_LEVEL_BUCKET, Decision, DecisionKey, bucket_text, parse_bucket, versions_hash
from autosel.dispatch import BucketTable
from autosel.errors import NoCandidateError, TuningError
from autosel.planned import kernel_of
from autosel.platforms import PlatformInfo, capturing_cuda_graph, version_vector
from autosel.policy import WEIGHTS_FROM_MEMORY
from autosel.timing import CudaGraphTimer, reads_weights
from autosel.registry import load_plugins, registry
from autosel.spec import KernelBackend, KernelSpec, OpDefinition, spec_list

log = logging.getLogger(__name__)

HINT_TUNING_OFF = (
    " [autosel: AUTOSEL_TUNE=off and no stored decision matches this machine; run `autosel tune` "
    "or unset AUTOSEL_TUNE to let autosel time the backends]"
)
HINT_NO_SHAPES = (
    " [autosel: no representative shapes are known for this op, so it cannot be timed; declare them with "
    "autosel.register_op(op, shapes=[...], make_inputs=...)]"
)


def multiple_backends_message(op: str, platform: PlatformInfo, eligible: list[KernelSpec]) -> str:
    return (f"op {op!r} has multiple backends usable on device {platform.device.value!r} "
            f"({spec_list(eligible)}); pass backend=... to choose one")


_databases: dict[tuple, Any] = {}
_databases_lock = threading.Lock()
_tunes_here: dict[DecisionKey, int] = {}  # key -> how many tunes of it this process has recorded
_announced: set[tuple[str, str]] = set()  # (op, mode) whose run-time tune this process has warned about


def database(settings: config.Settings | None = None):
    """The layered tuning DB for these settings, opened once per process."""
    from autosel.db import TuningDB

    settings = settings or config.settings()
    key = (settings.db, settings.db_path)
    with _databases_lock:
        if key not in _databases:
            _databases[key] = TuningDB.from_settings(settings)
        return _databases[key]


def decision_key(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 versions: dict[str, str] | None = None) -> DecisionKey:
    """The op-level key. versions: the version vector of `eligible`, if the caller has it already (reading it
    asks the installed packages' metadata)."""
    versions = version_vector(platform, eligible) if versions is None else versions
    return DecisionKey(platform.key, op, mode, OP_LEVEL_BUCKET, versions_hash(versions))


def table_of(decision: Decision, buckets: tuple[Decision, ...]) -> BucketTable:
    """What a dispatcher needs from an op-level decision and its bucket rows."""
    winners = {}
    for row in buckets:
        try:
            winners[parse_bucket(row.bucket)] = row.winner
        except ValueError:
            log.debug("op %r: bucket %r is not a bucket key; ignored", row.op, row.bucket)
    return BucketTable(decision.op, decision.mode, decision.winner, winners)


def decide(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
           settings: config.Settings) -> BucketTable:
    """The stored or measured decision of `op` as a bucket table; with several ranks, rank 0's whole table
    (autosel.distributed), so every rank dispatches every bucket alike."""
    from autosel.distributed import agree, check_against_local, check_eligible, op_agreement

    what, key = op_agreement(op, mode, platform.key)
    in_capture = capturing_cuda_graph()
    table = agree(lambda: _decide_here(op, eligible, platform, mode, settings), what=what, in_capture=in_capture,
                  key=key)
    check_eligible({table.default, *table.winners.values()}, {s.backend.value for s in eligible}, what=what)
    if settings.check_ranks:
        check_against_local(table, lambda: stored_table(op, eligible, platform, mode, settings), what=what,
                            in_capture=in_capture)
    return table


def stored_table(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 settings: config.Settings) -> BucketTable | None:
    """What this process's own DB layers hold for `op` (under AUTOSEL_MATCH), as a bucket table; None when they
    hold nothing. Never tunes: a rank's own answer for AUTOSEL_CHECK_RANKS."""
    versions = version_vector(platform, eligible)
    key, db = decision_key(op, eligible, platform, mode, versions), database(settings)
    found = lookup_stored(db, key, eligible, match=settings.match, versions=versions, say=False)
    if found is None and _why_not_timed(op, platform, settings):  # what _decide_here would run
        found = lookup_stored(db, key, eligible, match=settings.match, versions=versions, say=False,
                              every_backend=False)
    return None if found is None else table_of(*found[:2])


_near_said: set[tuple] = set()  # near-match rows this process has said it uses


def outdated(db, decision: Decision, layer, names: list[str], definition) -> str:
    """Why a stored op-level decision whose winner can run here is not this machine's answer now, or "": it never
    timed a backend eligible here (registered or installed since), its bucket rows run one that is not (gone
    since), it was checked with other tolerances or another reference than the op's now (`definition`), in
    graph mode on CUDA it was timed without reading the op's declared weights from memory, or its bucket rows are
    keyed otherwise than the op's bucket function keys their own shapes today (the function changed since, as
    gemm.mm's did in stop 36: no call looks its older rows up). That last one builds each row's inputs on the meta
    device, so it is judged last: 2-25 ms for a built-in op's table on a CPU at the op's first get_kernel (a shape is
    keyed once a process: the other mode's table reuses it), plus torch's import of torch._dynamo (about 1.5 s) at
    the first arithmetic on meta tensors in a process that had not imported it."""
    if untimed := decision.untimed(names):
        return f"never timed {', '.join(untimed)}, eligible here since it was made"
    rows = db.buckets(decision, layer)
    gone = sorted({row.winner for row in rows} - set(names))
    if gone:
        return f"has bucket rows that run {', '.join(gone)}, not eligible here since it was made"
    if definition is not None and decision.checked_with and decision.checked_with != definition.checked_with:
        return f"was checked with {decision.checked_with}; the op is checked with {definition.checked_with} now"
    if (definition is not None and definition.weights and reads_weights(CudaGraphTimer) and decision.mode == "graph"
            and decision.method.startswith("cuda:") and WEIGHTS_FROM_MEMORY not in decision.method):
        return ("was timed replaying one copy of its weights, which the L2 can hold; graph timing reads them from "
                "memory since stop 37 (docs/TUNING.md section 2)")
    if definition is not None and definition.bucket is not None:
        for row in rows:
            if (now := _keyed_today(row, definition)) is not None:
                return (f"has bucket rows keyed otherwise than the op's bucket function has keyed their shapes since "
                        f"it was made (such as {row.bucket}, now {now})")
    return ""


def _keyed_today(row: Decision, definition: OpDefinition) -> str | None:
    """The bucket the op's bucket function gives a row's first shape today, where that is not the row's (the
    function changed since the tune: gemm.mm's in stop 36); None when it is the row's, or cannot be told (inputs
    built on the "meta" device, shapes without data, that the op's make_inputs or bucket function refuses; a
    bucket that is no bucket key, which selection ignores too)."""
    shape = next((s.shape for c in row.candidates for s in c.shapes), None)
    if shape is None:
        return None
    try:
        stored = parse_bucket(row.bucket)
    except ValueError:  # no bucket key: table_of leaves the row out too
        return None
    cached = (definition.make_inputs, definition.bucket, json.dumps(shape, sort_keys=True))
    if cached not in _meta_keys:
        try:
            _meta_keys[cached] = tuple(definition.bucket(*definition.make_inputs(shape, "meta")))
        except Exception as exc:  # a user op's functions may not take meta tensors (or torch may be missing)
            log.debug("op %r: bucket of %s not told on meta tensors: %s", row.op, shape, exc)
            _meta_keys[cached] = None
    key = _meta_keys[cached]
    return bucket_text(key) if key is not None and key != stored else None


# Each shape's bucket as _keyed_today last told it, by the op's functions: an op's eager and graph tables share their
# shapes, and near matches (AUTOSEL_MATCH) judge several platforms' rows of them.
_meta_keys: dict[tuple, tuple | None] = {}


def lookup_stored(db, key: DecisionKey, eligible: list[KernelSpec], *, match: str = "exact",
                  versions: dict[str, str] | None = None, say: bool = True, every_backend: bool = True
                  ) -> tuple[Decision, tuple[Decision, ...], Any] | None:
    """The stored op-level decision, the bucket rows of its layer and that layer, or None. A row whose winner is
    not eligible here is passed over, and so, unless every_backend is false, is one that is `outdated`. match:
    AUTOSEL_MATCH; "device" or "arch" take the closest near row when no exact one is stored, and say so once unless
    `say` is false (versions: this machine's, for saying what differs)."""
    names = [s.backend.value for s in eligible]
    usable = set(names).__contains__
    definition = registry.definition(key.op)

    def fits(decision: Decision, layer) -> bool:
        return not every_backend or not outdated(db, decision, layer, names, definition)

    hit = db.lookup(key, usable=usable, fits=fits)
    near = hit is None and match != "exact"
    if near:
        hit = db.lookup_near(key, usable=usable, match=match, fits=fits)
    if hit is None:
        return None
    buckets = tuple(db.buckets(hit[0], hit[1], usable=usable))
    if near and say:
        _say_near(key, hit[0], hit[1], len(buckets), match, versions or {})
    return hit[0], buckets, hit[1]


def _say_near(key: DecisionKey, decision: Decision, layer, buckets: int, match: str, versions: dict[str, str]) -> None:
    from autosel.inventory import near_detail

    said = (key.op, key.mode, layer.path, decision.platform_key, decision.key.versions_hash)
    if said in _near_said:
        return
    _near_said.add(said)
    log.warning("op %r (%s mode): no decision is stored for this machine (%s) with its versions; AUTOSEL_MATCH=%s "
                "takes %s (and %d bucket row(s)) from the %s DB %s, a %s. Run `autosel tune` here to store an exact "
                "decision, or set AUTOSEL_MATCH=exact to refuse near matches", key.op, key.mode, key.platform_key,
                match, decision.winner, buckets, layer.kind, layer.path,
                near_detail(decision, key.platform_key, versions))


_untimed_said: set[tuple[str, str]] = set()  # (op, mode) whose older decision this process has said it keeps


def _say_untimed(op: str, mode: str, decision: Decision, reason: str, why: str) -> None:
    if (op, mode) in _untimed_said:
        return
    _untimed_said.add((op, mode))
    log.warning("op %r (%s mode): the stored decision (%s) %s; it is kept, since nothing can be timed now (%s). "
                "Run `autosel tune` to time every eligible backend", op, mode, decision.winner, reason, why)


def _decide_here(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 settings: config.Settings) -> BucketTable:
    """This process's answer: the stored decision, else (where timing is allowed) a tune now."""
    versions = version_vector(platform, eligible)
    key = decision_key(op, eligible, platform, mode, versions)
    db = database(settings)
    retune = settings.tune == "force" and key not in _tunes_here  # force: once per process
    older = None
    if not retune:
        found = lookup_stored(db, key, eligible, match=settings.match, versions=versions)
        if found is not None:
            decision, buckets, layer = found  # -v says which decision runs, as it says what a tune chose
            log.info("op %r (%s mode): %s, stored %s%s", op, mode, decision.winner,
                     "in memory" if layer.kind == "memory" else f"in the {layer.kind} DB {layer.path}",
                     f" with {len(buckets)} bucket rows" if buckets else "")
            return table_of(decision, buckets)
        older = lookup_stored(db, key, eligible, match=settings.match, versions=versions, every_backend=False,
                              say=False)
    # Where nothing can be timed now, a row that is only outdated (a newer backend, one gone, another check)
    # decides, rather than fail a served model at its start.
    why_not = _why_not_timed(op, platform, settings)
    reason = "" if older is None else outdated(db, older[0], older[2], spec_list(eligible), registry.definition(op))
    if older is not None and why_not:
        _say_untimed(op, mode, older[0], reason, why_not)
        if (older[0].platform_key, older[0].key.versions_hash) != (key.platform_key, key.versions_hash):
            _say_near(key, older[0], older[2], len(older[1]), settings.match, versions)
        return table_of(*older[:2])
    definition = _tunable(op, eligible, platform, mode, why_not)
    if (op, mode) not in _announced:  # a tune blocks the caller for tens of seconds: say so, once
        _announced.add((op, mode))
        why = (": AUTOSEL_TUNE=force is set" if retune else f"'s stored decision {reason}" if older is not None
               else " has no stored decision for this machine")
        _announce_tune(op, mode, why, eligible, settings, db)
    try:
        recorded = tune_and_record(definition, eligible, platform=platform, mode=mode, db=db,
                                   budget_s=settings.budget_s, force=retune)
    except NoCandidateError as exc:
        raise NoCandidateError(f"{exc}; fix the kernels named, or pass backend=... to choose one") from None
    rejected = [c for c in recorded.decision.candidates if c.status == "rejected"]
    if recorded.tuned and rejected:  # a broken kernel must not vanish unsaid: `autosel tune` shows it in its table
        log.warning("op %r (%s mode): rejected %s: %s", op, mode, ", ".join(c.backend for c in rejected),
                    "; ".join(f"{c.backend} {c.reason}" for c in rejected))
    return table_of(recorded.decision, recorded.buckets)


NO_SHAPES, TUNING_OFF, CAPTURE = "no representative shapes", "AUTOSEL_TUNE=off", "CUDA-graph capture"


def _why_not_timed(op: str, platform: PlatformInfo, settings: config.Settings) -> str:
    """Why `op` cannot be timed here and now (NO_SHAPES, TUNING_OFF, CAPTURE, in that order), "" when it can."""
    definition = registry.definition(op)
    if definition is None or not representative_shapes(definition, platform):  # before AUTOSEL_TUNE=off: no help
        return NO_SHAPES
    if settings.tune == "off":
        return TUNING_OFF
    return CAPTURE if capturing_cuda_graph() else ""


def _tunable(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str, why_not: str) -> OpDefinition:
    """The op's definition when it may be timed now (why_not, from _why_not_timed, is ""); else the contract's
    error: the original multiple-backends ValueError with a hint, or a TuningError inside CUDA-graph capture."""
    message = multiple_backends_message(op, platform, eligible)
    if why_not == NO_SHAPES:
        raise ValueError(message + HINT_NO_SHAPES)
    if why_not == TUNING_OFF:
        raise ValueError(message + HINT_TUNING_OFF)
    if why_not == CAPTURE:
        raise TuningError(f"op {op!r} has no stored {mode}-mode decision and cannot be timed while a CUDA graph "
                          "is being captured; call get_kernel for it before capture, or run `autosel tune`")
    return registry.definition(op)


def _announce_tune(op: str, mode: str, why: str, eligible: list[KernelSpec], settings: config.Settings, db) -> None:
    first = db.layers[0]
    kept = (f"stored in {settings.db}" if first.kind == "user" and first.writable else
            f"kept in this process's memory only ({settings.db} cannot be written, as warned)")
    log.warning("op %r (%s mode)%s, so its backends (%s) are timed now: this call blocks for the checks and "
                "compilation plus up to AUTOSEL_BUDGET_S=%g s of timing, and the decision is %s. To avoid the "
                "wait, run `autosel tune` before serving, or ship a tuning DB and point AUTOSEL_DB_PATH at it",
                op, mode, why, ", ".join(spec_list(eligible)), settings.budget_s, kept)


class Recorded(NamedTuple):
    """What tune_and_record leaves in the DB: the op-level decision, its bucket decisions, and whether this call
    timed them (False: another process recorded them while this one waited for the lease)."""

    decision: Decision
    buckets: tuple[Decision, ...]
    tuned: bool


def tune_and_record(definition: OpDefinition, eligible: list[KernelSpec], *, platform: PlatformInfo, mode: str,
                    db, budget_s: float, force: bool = False, shapes: list[dict] | None = None,
                    on_event: Callable | None = None, isolate_timeout_s: float | None = None,
                    reference: Callable[..., Any] | None = None, check_shapes: list[dict] | None = None) -> Recorded:
    """Tune under the DB's lease for (platform, op, mode), so processes on one device time it once; record the
    op-level decision and its per-bucket decisions together. Whoever takes the lease looks the decision up
    again first: another process may have written it since this one missed (one measured on every given shape,
    when `shapes` are given); then nothing is timed (Recorded.tuned is False). force: time it although a decision
    is stored, unless another thread of this process timed it while this one waited for the lease. A waiter whose
    lease holder left nothing it can use waits for the lease again: nothing is timed outside it. reference: what
    the candidates are checked against, by default reference_for(definition). check_shapes: the op's representative
    shapes on `platform` (by default read here): every candidate is checked on them, and on `shapes`, before any is
    timed, so that a candidate wrong at a shape `shapes` leave out never wins (its bucket would run it)."""
    from autosel import __version__
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    op = definition.op
    versions = version_vector(platform, eligible)  # read once: it asks the installed packages' metadata
    key = decision_key(op, eligible, platform, mode, versions)
    tunes_before = _tunes_here.get(key, 0)
    while True:
        with db.lease(platform.key, op, mode, budget_s=budget_s) as took:  # expires, and waiters stop, with the budget
            retune = force and _tunes_here.get(key, 0) == tunes_before  # another thread's forced tune is this one's
            found = None if retune else lookup_stored(db, key, eligible)
            if found is not None and (shapes is None or _decided_on(found[0], shapes)):
                return Recorded(*found[:2], tuned=False)
            if not took:  # its holder left nothing this call can use: wait for the lease again, never tune outside it
                continue
            tuner = Tuner(timer=timer_for(platform.torch_device, mode), device=platform.torch_device,
                          budget_s=budget_s, on_event=on_event, isolate_timeout_s=isolate_timeout_s)
            if check_shapes is None:
                check_shapes = representative_shapes(definition, platform)
            decision, buckets = tuner.tune_buckets(
                definition, eligible, reference=reference_for(definition) if reference is None else reference,
                shapes=shapes or check_shapes, check_shapes=check_shapes, mode=mode, platform_key=platform.key,
                versions=versions, autosel_version=__version__)
            db.record(decision, buckets)
            _tunes_here[key] = _tunes_here.get(key, 0) + 1
        break
    log.info("op %r (%s mode): %s chosen %s", op, mode, decision.winner,
             f"over {decision.runner_up}" if decision.runner_up else "(no runner-up measured to the end)")
    return Recorded(decision, tuple(buckets), tuned=True)


def representative_shapes(definition: OpDefinition, platform: PlatformInfo) -> list[dict]:
    """definition.shapes_for(platform); a shapes function that raises, or returns a shape JSON cannot hold (a
    torch.dtype), is a TuningError naming the op, so that a batch tune fails this op alone."""
    try:
        return definition.shapes_for(platform)
    except Exception as exc:  # a plug-in's code
        log.debug("op %r: its shapes function raised", definition.op, exc_info=True)
        raise TuningError(f"op {definition.op!r}: its shapes function (register_op's shapes=) failed: "
                          f"{type(exc).__name__}: {exc}. Fix that function: it takes the platform and returns the "
                          "representative shapes every candidate is checked on, as a list of dicts") from exc


def reference_for(definition: OpDefinition, spec: KernelSpec | None = None) -> Callable[..., Any]:
    """What the op's candidates are checked against: its reference backend's kernel, else its reference callable.
    spec: reference_spec(definition) already looked up (a TuneJob carries it), else it is looked up here."""
    spec = reference_spec(definition) if spec is None else spec
    return definition.reference if spec is None else kernel_of(definition, spec.load())


def reference_spec(definition: OpDefinition) -> KernelSpec | None:
    """The registered backend the op's candidates are checked against; None when the reference is a callable."""
    if callable(definition.reference) and not isinstance(definition.reference, KernelBackend):
        return None
    backend = definition.reference or KernelBackend.TORCH
    try:
        return registry.get_backend(definition.op, backend)
    except KeyError:
        raise TuningError(
            f"op {definition.op!r} has no reference to check candidates against: no '{backend.value}' backend is "
            "registered; register a torch backend or pass reference= to register_op"
        ) from None


# --- offline tuning of many ops (what `autosel tune` runs) -------------------------------------------------

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


def contested_ops(platform: PlatformInfo, patterns: list[str] | None = None) -> list[tuple[str, list[KernelSpec]]]:
    """Registered ops matching the glob patterns that have several backends eligible on `platform`."""
    load_plugins()
    result = []
    for op in registry.ops():
        if patterns and not any(fnmatch.fnmatchcase(op, p) for p in patterns):
            continue
        eligible = [s for s in registry.get(op) if s.is_available(platform)]
        if len(eligible) > 1:
            result.append((op, eligible))
    return result


def modes_for(platform: PlatformInfo) -> list[str]:
    """The modes a tune on `platform` times: eager and graph on a GPU with CUDA graphs, else eager only."""
    return list(platforms.modes_for_device(platform.device.value))


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
        done = parallel.run_jobs(jobs, workers, settings=settings, budget_s=budget_s, force=force,
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
            if found is not None and given and not _decided_on(found[0], given):
                found = None  # decided on other shapes: the caller asked for these to be timed
            if found is not None:
                stored, buckets, layer = found
                copy = copy_found and layer.kind != "user"
                if copy:
                    db.record(stored, buckets)
                status, where = ("copied", "copied from") if copy else ("stored", "stored in")
                covered = "; it was decided on every given shape; --force (force=True) times them again" if given else ""
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


def _decided_on(decision: Decision, shapes: list[dict]) -> bool:
    """Whether every one of `shapes` is among those `decision` was measured on."""
    measured = {shape for shape, _ in decision.per_shape_winners}
    return all(json.dumps(shape, sort_keys=True) in measured for shape in shapes)


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
