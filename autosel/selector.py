"""select_kernel / get_kernel: the original selector's contract, with "multiple backends usable" replaced by a
measured decision (docs/DESIGN.md section 1); get_kernel returns the plain kernel or a bucket dispatcher."""

from __future__ import annotations

import logging
import sys
from typing import Any, Callable

from autosel import config, platforms, state, tuning
from autosel.dispatch import BucketTable, dispatcher, recording, trace_as
from autosel.planned import PLANNED_NEAREST_WITHIN, Planner, planner_for
from autosel.platforms import PlatformInfo, capturing_cuda_graph
from autosel.registry import load_plugins, on_register, registry
from autosel.spec import KernelBackend, KernelSpec, spec_list
from autosel.state import KernelCache

log = logging.getLogger(__name__)


def _check_mode(mode: str | None) -> None:
    if mode is not None and mode not in config.EXECUTION_MODES:
        raise ValueError(f"mode={mode!r} is not valid; allowed values: {', '.join(config.EXECUTION_MODES)}")


def resolve_mode(mode: str | None, platform: PlatformInfo, settings: config.Settings | None = None) -> str:
    """The caller's mode, else graph while capturing, else AUTOSEL_MODE, else eager. Only a device with CUDA
    graphs (platforms.modes_for_device: CUDA, HIP) has a graph mode."""
    _check_mode(mode)
    if "graph" not in platforms.modes_for_device(platform.device.value):
        return "eager"
    if mode is not None:
        return mode
    if capturing_cuda_graph():
        return "graph"
    settings = settings or config.settings()
    return settings.mode or "eager"


def select_kernel(op: str, backend: KernelBackend | str | None = None, *, mode: str | None = None) -> KernelSpec:
    """Resolve `op` to one spec, the contract's table row by row (docs/DESIGN.md section 1); with several
    eligible, the op-level winner (get_kernel also dispatches by shape bucket)."""
    choice = _choose(op, backend, mode)
    return choice if isinstance(choice, KernelSpec) else choice[0]


def _choose(op: str, backend: KernelBackend | str | None, mode: str | None
            ) -> KernelSpec | tuple[KernelSpec, BucketTable, list[KernelSpec]]:
    """A spec, or for a measured decision (op-level winner, bucket table, eligible specs)."""
    load_plugins()
    specs = registry.get(op)
    if not specs:
        # The original selector's message stays as it was; a misspelt op gets the registered ops nearest to it in a
        # note that the traceback shows (Python 3.11 on), as unknown backends and AUTOSEL_BACKEND ops did already.
        error = KeyError(f"No kernels registered for op {op!r}")
        if hasattr(error, "add_note") and (hint := config.nearest_ops(op, registry.ops())):
            error.add_note(hint)
        raise error
    _check_mode(mode)  # with backend= too, where no mode is resolved: a typo would pass unseen
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
        missing = f"No '{forced.value}' backend registered for op {op!r}"
        if match is not None or per_op:  # the ranks not forced alike make the op's agreement: this one takes part too
            platform = platforms.current_platform()
            tuning.decide_fewer(op, [forced.value] if match is not None else [], missing,
                                mode=resolve_mode(mode, platform, settings), platform=platform, forced=forced.value)
        if match is not None:
            if (unusable := forced_unusable(op, match, specs, platform)) is not None:
                raise ValueError(unusable)
            log.info("op %r: AUTOSEL_BACKEND forces %r", op, forced.value)
            return match
        if per_op:
            raise KeyError(missing)
    platform = platforms.current_platform()
    eligible = [s for s in specs if s.is_available(platform)]
    if len(eligible) < 2:
        none_usable = (f"op {op!r} has no backend usable on device {platform.device.value!r} "
                       f"(registered: {spec_list(specs)})")
        # ranks that see several make the op's agreement: this one takes part, or they hang
        tuning.decide_fewer(op, [s.backend.value for s in eligible], none_usable,
                            mode=resolve_mode(mode, platform, settings), platform=platform)
        if not eligible:
            raise ValueError(none_usable)
        return eligible[0]
    table = tuning.decide(op, eligible, platform, resolve_mode(mode, platform, settings), settings)
    by_backend = {s.backend.value: s for s in eligible}
    return by_backend[table.default], table, eligible


def forced_unusable(op: str, spec: KernelSpec, specs: list[KernelSpec], platform: PlatformInfo) -> str | None:
    """Why the backend AUTOSEL_BACKEND forces for `op` cannot run here, or None. A forced Triton kernel on a CPU used
    to be returned and fail at its first call (`Torch not compiled with CUDA enabled`); an environment variable set
    for another machine is refused at selection instead. backend=... keeps the contract's "no device check"."""
    why = spec.unavailable_reason(platform)
    if why is None:
        return None
    usable = [s.backend.value for s in specs if s.is_available(platform)]
    return (f"AUTOSEL_BACKEND forces {spec.backend.value!r} for op {op!r}, which cannot run on device "
            f"{platform.device.value!r}: {why}. Force a backend usable here ({', '.join(usable) or 'none is'}) or "
            f"remove it from AUTOSEL_BACKEND; select_kernel({op!r}, backend={spec.backend.value!r}) still returns it "
            "unchecked")


# --- get_kernel: a cache that a concurrent clear_cache() cannot repopulate with stale entries --------------

# The cache, its generations (clear_cache() bumps one, _forget_kernels(op) the op's: a lookup in flight then stores
# nothing) and its lock are the process state's KernelCache (autosel.state).


def _stamp_locked(cache: KernelCache, op: str) -> tuple[int, int]:
    """What a lookup of `op` compares before and after its build; the caller holds cache.lock."""
    return cache.generation, cache.op_generations.get(op, 0)


def _stamp(cache: KernelCache, op: str) -> tuple[int, int]:
    with cache.lock:
        return _stamp_locked(cache, op)


def get_kernel(op: str, backend: KernelBackend | str | None = None, *, mode: str | None = None) -> Callable[..., Any]:
    """The callable for `op`, resolved through select_kernel and load(), cached per (op, backend, mode).

    With several eligible backends: the op-level winner's kernel when every shape bucket has the same winner,
    else a dispatcher (autosel.dispatch) whose mode is fixed here: while a CUDA graph is being captured the
    graph-mode one, so call get_kernel inside the captured code, or pass mode="graph" when building a model
    that will be captured. A warm call is one capture check and one dict lookup.
    """
    key = (op, backend, mode if mode is not None else ("graph" if capturing_cuda_graph() else None))
    cache = state.process.kernels
    fn = cache.kernels.get(key)  # no lock: clear_cache() swaps the dict, it never mutates one a reader holds
    if fn is not None:
        return fn
    if _compiling():  # a first call inside code torch.compile traces, as the selector autosel replaces allowed
        return getattr(sys.modules[__name__], _traced_name(key))
    load_plugins()  # before the stamp: the plug-ins' registrations are not news to this lookup
    during_decision = tuning.kernels_while_deciding()  # deciding another op for the ranks: kept for that decision
    if during_decision is not None:
        if key not in during_decision:
            during_decision[key] = _build(*key)
        return during_decision[key]
    stamp = _stamp(cache, op)
    tuning.agreement_kept()  # forget an earlier lookup's answer: this one's comes from _build
    fn = _build(*key)
    kept = tuning.agreement_kept()  # with several ranks, whether rank 0 had every rank keep this op's table
    with cache.lock:
        # A clear_cache(), or a registration for op, during the lookup wins: its result, chosen from the specs
        # before it, is returned but not stored, so the next call selects again. With several ranks rank 0's word
        # decides instead: a rank storing it while another does not would select alone, with a collective.
        if (stamp == _stamp_locked(cache, op)) if kept is None else kept:
            fn = cache.kernels.setdefault(key, fn)  # threads that built it at once all return the first one stored
    return fn


def _compiling() -> bool:
    torch = sys.modules.get("torch")  # no torch imported: nothing compiles
    return torch is not None and torch.compiler.is_compiling()


def _traced_name(key: tuple) -> str:
    """Resolve `key` for code torch.compile is tracing, and return the name of the module attribute that holds its
    kernel. Selecting takes locks, reads files and may tune, which torch.compile cannot trace (it failed on the
    lock's `with`): the mark below has it run this function as it is while tracing and take the name as a constant.
    Compiled code then reads the kernel through that attribute, which torch.compile can guard on (a function
    returned as a constant it cannot). The kernel is not put in the cache: the traced lookup found it missing there,
    and torch.compile checks right after tracing that this is still so."""
    cache = state.process.kernels  # .traced: key -> the name of this module's attribute that holds its kernel
    with cache.lock:
        name = cache.traced.get(key)
        if name is not None and getattr(sys.modules[__name__], name, None) is not None:
            return name
    load_plugins()
    while True:  # compiled code keeps the kernel it reads: never one chosen before a registration for the op
        stamp = _stamp(cache, key[0])
        fn = _build(*key)
        with cache.lock:
            if stamp != _stamp_locked(cache, key[0]):
                continue
            name = cache.traced.setdefault(key, f"_traced_kernel_{len(cache.traced)}")
            setattr(sys.modules[__name__], name, fn)
        return name


# What torch.compiler.assume_constant_result(_traced_name) sets, set here so that importing autosel imports no torch.
_traced_name._dynamo_marked_constant = True  # type: ignore[attr-defined]


def _build(op: str, backend: KernelBackend | str | None, mode: str | None) -> Callable[..., Any]:
    choice = _choose(op, backend, mode)
    definition = registry.definition(op)
    if definition is not None and definition.planned:
        return _build_planner(op, choice, definition, mode)
    if isinstance(choice, KernelSpec):
        fn = choice.load()
        mode_name = mode or "eager"
        if definition is not None:
            trace_as(fn, definition.traced_kernel(choice.backend.value, fn))
    else:
        _, table, eligible = choice
        mode_name = table.mode
        tuning.cached_alone(op)
        named = {table.default, *table.winners.values()}
        kernels = {s.backend.value: s.load() for s in eligible if s.backend.value in named}
        traced = {b: definition.traced_kernel(b, k) for b, k in kernels.items()} if definition else kernels
        if definition is not None and definition.bucket is not None:
            fn = dispatcher(table, kernels, definition.bucket, definition.route_key, traced)
        else:
            fn = kernels[table.default]
        if fn is kernels[table.default]:  # a uniform table, or no bucket function: the plain kernel
            trace_as(fn, traced[table.default])
    record_to = config.record_path()
    if record_to is not None:
        fn = recording(op, fn, record_to, mode_name, definition.shape_of if definition else None)
    return fn


def _build_planner(op: str, choice, definition, mode: str | None) -> Planner:
    """A planned op's Planner (autosel.planned): the chosen backend's plan class, or for a measured decision the
    bucket's winner per batch, with every eligible class loaded to stand in where a winner cannot run a batch."""
    if isinstance(choice, KernelSpec):
        classes, route = {choice.backend.value: choice.load()}, (lambda batch: choice.backend.value)
        mode = mode or "eager"
    else:
        _, table, eligible = choice
        mode = table.mode
        tuning.cached_alone(op)
        classes = {s.backend.value: s.load() for s in eligible}
        winners: dict[tuple, str] = {}  # bucket -> backend, each bucket routed once (BucketTable.route)

        def route(batch) -> str:
            if definition.bucket is None:
                return table.default
            key = definition.bucket(batch)
            return winners.get(key) or winners.setdefault(key, table.route(key, within=PLANNED_NEAREST_WITHIN))
    planner = planner_for(op, classes, route)
    record_to = config.record_path()
    if record_to is not None:  # a planned op's batches are recorded as their plans are made
        planner.make_plan = recording(op, planner.make_plan, record_to, mode, definition.shape_of)
    return planner
def clear_cache() -> None:
    """Forget every resolved kernel; lookups in flight finish but do not repopulate the new cache. With several
    ranks it also forgets the tables agreed with rank 0, so call it on every rank alike: the next selection of
    each op is a collective again (autosel.distributed). The warnings given once are given again, AUTOSEL_RECORD
    appends each shape again, and what was derived from code (fingerprints) is derived again (state.ProcessState)."""
    _forget_kernels()
    state.process.forget()


def _forget_kernels(op: str | None = None) -> None:
    """Forget the resolved kernels (of `op` only, if given), those in the cache and those being resolved: a lookup
    in flight may have read the registry before this registration, so it stores nothing, cached kernels or not.
    With several ranks, forget the tables agreed with rank 0 too: else every rank would select the agreed table
    again, which never timed the new backend (registered on every rank alike, the next selection is a collective
    on each)."""
    cache = state.process.kernels
    with cache.lock:
        if op is None:
            cache.generation += 1
        else:
            cache.op_generations[op] = cache.op_generations.get(op, 0) + 1
        dropped = [fn for key, fn in cache.kernels.items() if op is None or key[0] == op]
        cache.kernels = {key: fn for key, fn in cache.kernels.items() if op is not None and key[0] != op}
        for key, name in cache.traced.items():  # compiled code guarded on the kernel it read: it traces again
            if op is None or key[0] == op:
                setattr(sys.modules[__name__], name, None)
    for fn in dropped:  # a dispatcher lives on with torch's stand-in: its learned shapes need not
        getattr(fn, "forget_shapes", lambda: None)()
    tuning.forget_decided(op)


# A backend registered for an op already resolved is timed at its next selection (a stored decision that never
# timed it is a miss), and an op defined after its kernels were resolved brings a bucket function and traced=:
# get_kernel forgets that op's kernels, so it selects again, as select_kernel does.
on_register(_forget_kernels)
