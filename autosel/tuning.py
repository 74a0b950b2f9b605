"""Deciding an op: the stored decision from the DB layers, else a tune now under the DB's lease, with several ranks
rank 0's (autosel.distributed). Batch tuning of many ops (what `autosel tune` runs) is autosel.batch's."""

from __future__ import annotations

import fnmatch
import json
import logging
from dataclasses import replace
from typing import Any, Callable, NamedTuple

from autosel import config, distributed, platforms, rank_check, state
from autosel.decisions import (OP_LEVEL_BUCKET, Decision, DecisionKey, near_detail, parse_bucket,
                               version_diff, versions_hash)
from autosel.dispatch import BucketTable
from autosel.errors import NoCandidateError, TuningError
from autosel.planned import kernel_of
from autosel.platforms import PlatformInfo, capturing_cuda_graph, version_vector
from autosel.version import __version__
from autosel.registry import load_plugins, registry
from autosel.spec import KernelBackend, KernelSpec, OpDefinition, spec_list
from autosel.staleness import fingerprint, outdated, platform_of_key

log = logging.getLogger(__name__)

HINT_TUNING_OFF = (
    " [autosel: AUTOSEL_TUNE=off and no stored decision matches this machine; run `autosel tune` "
    "or unset AUTOSEL_TUNE to let autosel time the backends]"
)
HINT_TUNING_OFF_SCRIPT = (
    " [autosel: AUTOSEL_TUNE=off and no stored decision matches this machine; this op is registered by this process,"
    " not through an `autosel.ops` entry point, so `autosel tune` does not see it: unset AUTOSEL_TUNE in this "
    "process to time the backends and store the decision, or register the op through an `autosel.ops` entry point "
    "(the README shows one) so that `autosel tune` sees it]"
)
HINT_NO_SHAPES = (
    " [autosel: no representative shapes are known for this op, so it cannot be timed; declare them with "
    "autosel.register_op(op, shapes=[...], make_inputs=...)]"
)


def multiple_backends_message(op: str, platform: PlatformInfo, eligible: list[KernelSpec]) -> str:
    return (f"op {op!r} has multiple backends usable on device {platform.device.value!r} "
            f"({spec_list(eligible)}); pass backend=... to choose one")


# The open DBs, the tunes this process recorded and the warnings given once: the process state's Memos
# (autosel.state).


def database(settings: config.Settings | None = None):
    """The layered tuning DB for these settings, opened once per process."""
    from autosel.db import TuningDB

    settings = settings or config.settings()
    key = (settings.db, settings.db_path)
    memos = state.process.memos
    with memos.lock:
        if key not in memos.databases:
            memos.databases[key] = TuningDB.from_settings(settings)
        return memos.databases[key]


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
    what, key = distributed.op_agreement(op, mode, platform.key)
    in_capture = capturing_cuda_graph()
    table = distributed.agree(lambda: _decide_here(op, eligible, platform, mode, settings), what=what,
                              in_capture=in_capture, key=key)
    distributed.check_eligible({table.default, *table.winners.values()}, {s.backend.value for s in eligible},
                               what=what)
    if settings.check_ranks:
        rank_check.check_against_local(table, lambda: stored_table(op, eligible, platform, mode, settings),
                                       what=what, in_capture=in_capture)
    return table


# --- what selection asks of the ranks' agreement (autosel.distributed), so that the contract never calls it ------

def decide_fewer(op: str, usable: list[str], none_usable: str, *, mode: str, platform: PlatformInfo,
                 forced: str | None = None) -> None:
    """With several ranks, take part in `op`'s agreement where this rank has nothing to decide (fewer than two
    usable backends, or one AUTOSEL_BACKEND forces), as decide does where it has: the ranks that decide would
    otherwise wait for this one (distributed.agree_on_fewer, which raises where this rank cannot run rank 0's
    table). In a single process, nothing."""
    if distributed.in_process_group():
        distributed.agree_on_fewer(op, usable, none_usable, mode=mode, platform_key=platform.key, forced=forced)


def kernels_while_deciding() -> dict | None:
    """While this thread makes rank 0's decision of another op, get_kernel's cache for what it selects meanwhile
    (distributed.decision_kernels); None otherwise."""
    return distributed.decision_kernels()


def agreement_kept() -> bool | None:
    """Whether every rank keeps the decision this thread's last selection agreed on (rank 0's word); None where it
    agreed on none. Asking clears it (distributed.agreement_kept)."""
    return distributed.agreement_kept()


def cached_alone(op: str) -> None:
    """get_kernel cached `op`'s kernel from a measured decision: with no process group up, this rank's own choice,
    which the ranks warn about when they first agree (state.Agreements.chosen_alone)."""
    if not distributed.in_process_group():
        state.process.agreements.chosen_alone.add(op)


def forget_decided(op: str | None = None) -> None:
    """Forget the decisions agreed with rank 0 and the ops chosen alone, of `op` only if given (clear_cache, or a
    registration for op): the next selection of each is a collective again, on every rank alike."""
    chosen_alone = state.process.agreements.chosen_alone
    if op is None:
        chosen_alone.clear()
    else:
        chosen_alone.discard(op)
    distributed.forget_agreements(op)


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
        return not every_backend or not outdated(db, decision, layer, names, definition, eligible)

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
    said = (key.op, key.mode, layer.path, decision.platform_key, decision.key.versions_hash)
    near_said = state.process.memos.near_said
    if said in near_said:
        return
    near_said.add(said)
    log.warning("op %r (%s mode): no decision is stored for this machine (%s) with its versions; AUTOSEL_MATCH=%s "
                "takes %s (and %d bucket row(s)) from the %s DB %s, a %s. Run `autosel tune` here to store an exact "
                "decision, or set AUTOSEL_MATCH=exact to refuse near matches", key.op, key.mode, key.platform_key,
                match, decision.winner, buckets, layer.kind, layer.path,
                near_detail(decision, key.platform_key, versions))


def _say_untimed(op: str, mode: str, decision: Decision, reason: str, why: str) -> None:
    untimed_said = state.process.memos.untimed_said
    if (op, mode) in untimed_said:
        return
    untimed_said.add((op, mode))
    log.warning("op %r (%s mode): the stored decision (%s) %s; it is kept, since nothing can be timed now (%s). "
                "Run `autosel tune` to time every eligible backend", op, mode, decision.winner, reason, why)


def _decide_here(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 settings: config.Settings) -> BucketTable:
    """This process's answer: the stored decision, else (where timing is allowed) a tune now."""
    versions = version_vector(platform, eligible)
    key = decision_key(op, eligible, platform, mode, versions)
    db = database(settings)
    memos = state.process.memos
    retune = settings.tune == "force" and key not in memos.tunes_here  # force: once per process
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
    reason = "" if older is None else outdated(db, older[0], older[2], spec_list(eligible), registry.definition(op),
                                               eligible)
    if older is not None and not reason:  # current: another process recorded it between the two lookups (this one
        decision, buckets, layer = older  # lost the tune race), so it is this process's answer, with nothing timed
        log.info("op %r (%s mode): %s, stored by another process in the %s DB %s while this one looked", op, mode,
                 decision.winner, layer.kind, layer.path)
        return table_of(decision, buckets)
    if older is not None and why_not:
        _say_untimed(op, mode, older[0], reason, why_not)
        if (older[0].platform_key, older[0].key.versions_hash) != (key.platform_key, key.versions_hash):
            _say_near(key, older[0], older[2], len(older[1]), settings.match, versions)
        return table_of(*older[:2])
    definition = _tunable(op, eligible, platform, mode, why_not,
                          stored_elsewhere=_stored_for_other_backends(db, key, eligible, platform, versions)
                          if why_not == TUNING_OFF else "")
    if (op, mode) not in memos.announced:  # a tune blocks the caller for tens of seconds: say so, once
        memos.announced.add((op, mode))
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


def _tunable(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str, why_not: str, *,
             stored_elsewhere: str = "") -> OpDefinition:
    """The op's definition when it may be timed now (why_not, from _why_not_timed, is ""); else the contract's
    error: the original multiple-backends ValueError with a hint (and stored_elsewhere's, under AUTOSEL_TUNE=off),
    or a TuningError inside CUDA-graph capture."""
    message = multiple_backends_message(op, platform, eligible)
    if why_not == NO_SHAPES:
        raise ValueError(message + HINT_NO_SHAPES)
    if why_not == TUNING_OFF:
        raise ValueError(message + (HINT_TUNING_OFF if registry.from_entry_point(op) else HINT_TUNING_OFF_SCRIPT)
                         + stored_elsewhere)
    if why_not == CAPTURE:
        raise TuningError(f"op {op!r} has no stored {mode}-mode decision and cannot be timed while a CUDA graph "
                          "is being captured; call get_kernel for it before capture, or run `autosel tune`")
    return registry.definition(op)


def _stored_for_other_backends(db, key: DecisionKey, eligible: list[KernelSpec], platform: PlatformInfo,
                              versions: dict[str, str]) -> str:
    """A hint on the decision stored for this device that selection passed over (its winner cannot run here, or it
    has another version vector): what differs, and the backends it timed that cannot run in this process, with
    why; "" when none is stored. A vendor package missing from a process's path leaves the others eligible, so a
    fresh tune's DB missed on the very machine that made it (`autosel bench attention-step` on the H200) with
    nothing saying why."""
    found = db.lookup(key) or db.lookup_near(key, match="device")
    if found is None:
        return ""
    decision, layer = found
    here = {s.backend.value for s in eligible}
    specs = {s.backend.value: s for s in registry.get(key.op)}
    gone = [f"{c.backend}: " + (specs[c.backend].unavailable_reason(platform) or "usable here") if c.backend in specs
            else f"{c.backend}: not registered in this process" for c in decision.candidates if c.backend not in here]
    return (f" [autosel: the {layer.kind} DB {layer.path} holds a decision for this device in {key.mode} mode "
            f"({decision.winner}) that this process cannot use ({version_diff(decision.versions, versions)})"
            + (f"; of the backends it timed, these cannot run in this process: {'; '.join(gone)}" if gone else "")
            + "]")


def _announce_tune(op: str, mode: str, why: str, eligible: list[KernelSpec], settings: config.Settings, db) -> None:
    first = db.layers[0]
    kept = (f"stored in {settings.db}" if first.kind == "user" and first.writable else
            f"kept in this process's memory only ({settings.db} cannot be written, as warned)")
    log.warning("op %r (%s mode)%s, so its backends (%s) are timed now: this call blocks for the checks and "
                "compilation plus up to AUTOSEL_BUDGET_S=%g s of timing, and the decision is %s. To avoid the "
                "wait, %s before serving, or ship a tuning DB and point AUTOSEL_DB_PATH at it",
                op, mode, why, ", ".join(spec_list(eligible)), settings.budget_s, kept,
                "run `autosel tune`" if registry.from_entry_point(op) else  # the CLI does not see a script's ops
                "make this call once (this op is registered by this process, not through an `autosel.ops` entry "
                "point, so `autosel tune` does not see it)")


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
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    op = definition.op
    versions = version_vector(platform, eligible)  # read once: it asks the installed packages' metadata
    key = decision_key(op, eligible, platform, mode, versions)
    tunes_here = state.process.memos.tunes_here
    tunes_before = tunes_here.get(key, 0)
    while True:
        with db.lease(platform.key, op, mode, budget_s=budget_s) as took:  # expires, and waiters stop, with the budget
            retune = force and tunes_here.get(key, 0) == tunes_before  # another thread's forced tune is this one's
            found = None if retune else lookup_stored(db, key, eligible)
            if found is not None and (shapes is None or decided_on(found[0], shapes)):
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
            # What makes these rows stale once it changes; asked of the platform as its key says, as when judged.
            measured_on = fingerprint(definition, eligible, platform_of_key(platform.key))
            decision = replace(decision, fingerprint=measured_on)
            buckets = [replace(row, fingerprint=measured_on) for row in buckets]
            db.record(decision, buckets)
            tunes_here[key] = tunes_here.get(key, 0) + 1
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


def decided_on(decision: Decision, shapes: list[dict]) -> bool:
    """Whether every one of `shapes` is among those `decision` was measured on."""
    measured = {shape for shape, _ in decision.per_shape_winners}
    return all(json.dumps(shape, sort_keys=True) in measured for shape in shapes)
