"""select_kernel / get_kernel: the original selector's contract, with "multiple backends usable" replaced by a measured decision."""

from __future__ import annotations

import fnmatch
import json
import logging
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

from autosel import config
from autosel.decisions import OP_LEVEL_BUCKET, Decision, DecisionKey, versions_hash
from autosel.errors import TuningError
from autosel.platforms import PlatformInfo, current_platform, version_vector
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


def _platform() -> PlatformInfo:
    """The platform selection runs on (tests monkeypatch this)."""
    return current_platform()


def multiple_backends_message(op: str, platform: PlatformInfo, eligible: list[KernelSpec]) -> str:
    return (f"op {op!r} has multiple backends usable on device {platform.device.value!r} "
            f"({spec_list(eligible)}); pass backend=... to choose one")


def capturing_cuda_graph() -> bool:
    """True while a CUDA graph is being captured on the current stream; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def resolve_mode(mode: str | None, platform: PlatformInfo, settings: config.Settings | None = None) -> str:
    """The caller's mode, else graph while capturing, else AUTOSEL_MODE, else eager. Only CUDA has graphs."""
    if mode is not None and mode not in config.EXECUTION_MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(config.EXECUTION_MODES)}")
    if platform.torch_device != "cuda":
        return "eager"
    if mode is not None:
        return mode
    if capturing_cuda_graph():
        return "graph"
    settings = settings or config.settings()
    return settings.mode or "eager"


def decision_key(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 versions: dict[str, str] | None = None) -> DecisionKey:
    """versions: the version vector of `eligible`, if the caller has it already (reading it asks the installed
    packages' metadata)."""
    versions = version_vector(platform, eligible) if versions is None else versions
    return DecisionKey(platform.key, op, mode, OP_LEVEL_BUCKET, versions_hash(versions))


def select_kernel(op: str, backend: KernelBackend | str | None = None, *, mode: str | None = None) -> KernelSpec:
    """Resolve `op` to one spec. The table in docs/DESIGN.md section 1, row by row."""
    load_plugins()
    specs = registry.get(op)
    if not specs:
        raise KeyError(f"No kernels registered for op {op!r}")
    if backend is not None:
        backend = KernelBackend.parse(backend)
        for spec in specs:
            if spec.backend == backend:
                return spec
        raise KeyError(f"No '{backend.value}' backend registered for op {op!r}")
    if len(specs) == 1:
        return specs[0]
    settings = config.settings()
    forced, per_op = settings.forced_backend_for(op)
    if forced is not None:
        match = next((s for s in specs if s.backend == forced), None)
        if match is not None:
            log.info("op %r: AUTOSEL_BACKEND forces %r", op, forced.value)
            return match
        if per_op:
            raise KeyError(f"No '{forced.value}' backend registered for op {op!r}")
    platform = _platform()
    eligible = [s for s in specs if s.is_available(platform)]
    if len(eligible) == 1:
        return eligible[0]
    if not eligible:
        raise ValueError(f"op {op!r} has no backend usable on device {platform.device.value!r} "
                         f"(registered: {spec_list(specs)})")
    return _decide(op, eligible, platform, resolve_mode(mode, platform, settings), settings)


# --- decisions: DB layers first, else tune now -------------------------------------------------------------

_databases: dict[tuple, Any] = {}
_databases_lock = threading.Lock()
_forced_done: set[DecisionKey] = set()


def database(settings: config.Settings | None = None):
    """The layered tuning DB for these settings, opened once per process."""
    from autosel.db import TuningDB

    settings = settings or config.settings()
    key = (settings.db, settings.db_path)
    with _databases_lock:
        if key not in _databases:
            _databases[key] = TuningDB.from_settings(settings)
        return _databases[key]


def _decide(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
            settings: config.Settings) -> KernelSpec:
    """The stored or measured winner; with several ranks, rank 0's (autosel.distributed)."""
    from autosel.distributed import agree, check_eligible

    by_backend = {s.backend.value: s for s in eligible}
    what = f"op {op!r} ({mode} mode)"
    winner = agree(lambda: _decide_here(op, eligible, platform, mode, settings), what=what,
                   in_capture=capturing_cuda_graph())
    check_eligible(winner, set(by_backend), what=what)
    return by_backend[winner]


def _decide_here(op: str, eligible: list[KernelSpec], platform: PlatformInfo, mode: str,
                 settings: config.Settings) -> str:
    by_backend = {s.backend.value: s for s in eligible}
    key = decision_key(op, eligible, platform, mode)
    db = database(settings)
    retune = settings.tune == "force" and key not in _forced_done
    if not retune:
        hit = db.lookup(key, usable=by_backend.__contains__)
        if hit is not None:
            return hit[0].winner
    message = multiple_backends_message(op, platform, eligible)
    if settings.tune == "off":
        raise ValueError(message + HINT_TUNING_OFF)
    definition = registry.definition(op)
    if definition is None or not definition.shapes_for(platform):
        raise ValueError(message + HINT_NO_SHAPES)
    if capturing_cuda_graph():
        raise TuningError(f"op {op!r} has no stored {mode}-mode decision and cannot be timed while a CUDA graph "
                          "is being captured; call get_kernel for it before capture, or run `autosel tune`")
    decision = tune_and_record(definition, eligible, platform=platform, mode=mode, db=db,
                               budget_s=settings.budget_s, force=retune)
    return decision.winner


def tune_and_record(definition: OpDefinition, eligible: list[KernelSpec], *, platform: PlatformInfo, mode: str,
                    db, budget_s: float, force: bool = False, shapes: list[dict] | None = None,
                    on_event: Callable | None = None, isolate_timeout_s: float | None = None) -> Decision:
    """Tune under the DB's lease for (platform, op, mode), so processes on one device time it once; record it."""
    from autosel import __version__
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    op = definition.op
    versions = version_vector(platform, eligible)  # read once: it asks the installed packages' metadata
    key = decision_key(op, eligible, platform, mode, versions)
    usable = {s.backend.value for s in eligible}.__contains__
    with db.lease(platform.key, op, mode, ttl_s=max(600.0, 4 * budget_s)) as holder:
        if not holder and not force:
            hit = db.lookup(key, usable=usable)
            if hit is not None:
                return hit[0]
        tuner = Tuner(timer=timer_for(platform.torch_device, mode), device=platform.torch_device,
                      budget_s=budget_s, on_event=on_event, isolate_timeout_s=isolate_timeout_s)
        decision = tuner.tune(definition, eligible, reference=reference_for(definition, eligible),
                              shapes=shapes or definition.shapes_for(platform), mode=mode,
                              platform_key=platform.key, versions=versions,
                              autosel_version=__version__)
        db.record(decision)
    _forced_done.add(key)
    log.info("op %r (%s mode): %s chosen over %s", op, mode, decision.winner, decision.runner_up)
    return decision


def reference_for(definition: OpDefinition, eligible: list[KernelSpec]) -> Callable[..., Any]:
    """The op's declared reference: a callable, a backend of the op, or by default its torch backend."""
    if callable(definition.reference) and not isinstance(definition.reference, KernelBackend):
        return definition.reference
    backend = definition.reference or KernelBackend.TORCH
    try:
        return registry.get_backend(definition.op, backend).load()
    except KeyError:
        raise TuningError(
            f"op {definition.op!r} has no reference to check candidates against: no '{backend.value}' backend is "
            "registered; register a torch backend or pass reference= to register_op"
        ) from None


# --- get_kernel: a cache that a concurrent clear_cache() cannot repopulate with stale entries --------------

_cache: dict[tuple, Callable[..., Any]] = {}
_generation = 0
_cache_lock = threading.Lock()


def get_kernel(op: str, backend: KernelBackend | str | None = None, *, mode: str | None = None) -> Callable[..., Any]:
    """The callable for `op`, resolved through select_kernel and load(), cached per (op, backend, mode)."""
    if backend is not None:
        backend = KernelBackend.parse(backend)
    cache_key = (op, backend, mode if mode is not None else ("graph" if capturing_cuda_graph() else None))
    with _cache_lock:
        generation = _generation
        fn = _cache.get(cache_key)
    if fn is not None:
        return fn
    fn = select_kernel(op, backend, mode=cache_key[2]).load()
    record_to = config.settings().record
    if record_to is not None:
        fn = _recording(op, fn, record_to, cache_key[2] or "eager")
    with _cache_lock:
        if generation == _generation:  # a clear_cache() during the lookup wins: do not store a stale entry
            _cache[cache_key] = fn
    return fn


_recorded: set[tuple[str, str, str]] = set()
_record_lock = threading.Lock()


def _recording(op: str, fn: Callable[..., Any], path, mode: str) -> Callable[..., Any]:
    """Wrap `fn` so each new shape bucket of `op` is appended to `path` once per process (no timing)."""
    definition = registry.definition(op)
    if definition is None or definition.shape_of is None:
        log.warning("AUTOSEL_RECORD: op %r declares no shape_of, so its calls are not recorded", op)
        return fn

    def recorded(*args, **kwargs):
        shape = json.dumps(definition.shape_of(*args, **kwargs), sort_keys=True)
        if (op, mode, shape) not in _recorded:
            with _record_lock:
                if (op, mode, shape) not in _recorded:
                    _recorded.add((op, mode, shape))
                    with open(path, "a", encoding="utf-8") as f:
                        f.write(json.dumps({"op": op, "shape": json.loads(shape), "mode": mode}) + "\n")
        return fn(*args, **kwargs)

    recorded.__wrapped__ = fn  # type: ignore[attr-defined]
    return recorded


def clear_cache() -> None:
    """Forget every resolved kernel; lookups in flight finish but do not repopulate the new cache."""
    global _cache, _generation
    with _cache_lock:
        _generation += 1
        _cache = {}


# --- offline tuning of many ops (what `autosel tune` runs) -------------------------------------------------

@dataclass(frozen=True)
class TuneOutcome:
    """One (op, mode) of a batch tune: a fresh decision, a stored one reused, or why there is none."""

    op: str
    mode: str
    status: str  # "tuned", "stored", "copied" (from a shipped layer), "failed"
    decision: Decision | None = None
    detail: str = ""


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
    """CUDA tunes both execution modes (prefill launches eagerly, decode replays graphs); others eager only."""
    return list(config.EXECUTION_MODES) if platform.torch_device == "cuda" else ["eager"]


def tune_ops(patterns: list[str] | None = None, *, force: bool = False, budget_s: float | None = None,
             shapes: dict[str, list[dict]] | None = None, modes: list[str] | None = None,
             on_event: Callable | None = None, settings: config.Settings | None = None,
             isolate_timeout_s: float | None = None, copy_found: bool = False) -> list[TuneOutcome]:
    """Tune every contested op (or those matching `patterns`) in every mode; stored decisions are reused.

    isolate_timeout_s: check each candidate first in a child process killed after this many seconds.
    copy_found: a decision found in a shipped layer is copied into the user layer (status "copied"), so a
    DB built for an image (`autosel tune --db build.db`) holds every decision, not only the new ones.
    """
    settings = settings or config.settings()
    platform, db = _platform(), database(settings)
    outcomes = []
    for op, eligible in contested_ops(platform, patterns):
        definition = registry.definition(op)
        for mode in modes or modes_for(platform):
            key = decision_key(op, eligible, platform, mode)
            hit = None if force else db.lookup(key, usable={s.backend.value for s in eligible}.__contains__)
            if hit is not None and copy_found and hit[1].kind != "user":
                db.record(hit[0])
                outcomes.append(TuneOutcome(op, mode, "copied", hit[0], f"copied from {hit[1].path}"))
                continue
            if hit is not None:
                outcomes.append(TuneOutcome(op, mode, "stored", hit[0], f"stored in {hit[1].path}"))
                continue
            op_shapes = (shapes or {}).get(op) or (definition.shapes_for(platform) if definition else [])
            if definition is None or not op_shapes:
                outcomes.append(TuneOutcome(op, mode, "failed", None,
                                            "no representative shapes; declare them with autosel.register_op"))
                continue
            try:
                decision = tune_and_record(definition, eligible, platform=platform, mode=mode, db=db,
                                           budget_s=budget_s or settings.budget_s, force=force,
                                           shapes=op_shapes, on_event=on_event,
                                           isolate_timeout_s=isolate_timeout_s)
            except TuningError as exc:
                outcomes.append(TuneOutcome(op, mode, "failed", None, str(exc)))
                continue
            outcomes.append(TuneOutcome(op, mode, "tuned", decision))
    return outcomes
