"""The process-wide registry of kernel specs and op definitions, and the plug-in entry points that fill it.

The process-wide `registry` runs the `autosel.ops` entry points before its first read or registration, so
every reader sees the plug-ins' ops and a user's registration that conflicts with a plug-in's fails at the
user's own call, never inside the plug-in. autosel's own entry point runs first, so a built-in op is never
replaced by a plug-in that happens to be listed earlier.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import inspect
import logging
import os
import threading
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

from autosel import config, state
from autosel.spec import KernelBackend, KernelSpec, OpDefinition, check_shapes

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "autosel.ops"


class KernelRegistry:
    """Specs per op in registration order; registration order is also the tie-break order when tuning.

    `load`, if given, runs before every read and registration (the process-wide registry passes load_plugins;
    a registry built by a test starts empty and stays so).
    """

    def __init__(self, load: Callable[[], None] | None = None) -> None:
        self._specs: dict[str, list[KernelSpec]] = defaultdict(list)
        self._ops: dict[str, OpDefinition] = {}
        self._lock = threading.RLock()
        self._load = load
        self._plugin_ops: set[str] = set()  # ops an `autosel.ops` entry point registered: what the CLI sees too

    def _loaded(self) -> None:
        if self._load is not None:
            self._load()

    def register(self, spec: KernelSpec) -> KernelSpec:
        self._loaded()
        with self._lock:
            existing = self._specs[spec.op]
            for current in existing:
                if current.backend != spec.backend:
                    continue
                if current == spec:
                    return current
                # Silently replacing would make selection depend on import order.
                differ, _ = _differences(current, spec)
                return _conflict(current, ValueError(
                    f"Conflicting kernel registration for op {spec.op!r} backend {spec.backend.value!r}: "
                    f"already registered with {'; '.join(differ)}; "
                    "register each (op, backend) once, or register your kernel under an op name of your own "
                    "(e.g. 'myengine.rmsnorm')"
                ))
            existing.append(spec)
            _journal(self, spec)
            if getattr(_loading, "plugin", None) is not None:
                self._plugin_ops.add(spec.op)
        for listener in _listeners:
            listener(spec.op)
        return spec

    def define(self, definition: OpDefinition) -> OpDefinition:
        self._loaded()
        with self._lock:
            current = self._ops.get(definition.op)
            if current is not None:
                return current if current == definition else _conflict(current, _op_conflict(current, definition))
            self._ops[definition.op] = definition
            _journal(self, definition)
        for listener in _listeners:  # its bucket function and traced= change what get_kernel returns
            listener(definition.op)
        return definition

    def _forget(self, registered: KernelSpec | OpDefinition) -> None:
        """Undo one registration (made by a plug-in whose hook then raised)."""
        with self._lock:
            if isinstance(registered, KernelSpec):
                specs = self._specs.get(registered.op, [])
                specs[:] = [s for s in specs if s is not registered]
            elif self._ops.get(registered.op) is registered:
                del self._ops[registered.op]

    def from_entry_point(self, op: str) -> bool:
        """Whether an `autosel.ops` entry point registered `op`, so that every process, the CLI's included, has it;
        an op a script registers exists in that script's processes only."""
        self._loaded()
        return op in self._plugin_ops

    def get(self, op: str) -> list[KernelSpec]:
        self._loaded()
        with self._lock:
            return list(self._specs.get(op, ()))

    def get_backend(self, op: str, backend: KernelBackend | str) -> KernelSpec:
        backend = KernelBackend.parse(backend)
        for spec in self.get(op):
            if spec.backend == backend:
                return spec
        raise KeyError(f"No '{backend.value}' backend registered for op {op!r}")

    def definition(self, op: str) -> OpDefinition | None:
        self._loaded()
        with self._lock:
            return self._ops.get(op)

    def has(self, op: str) -> bool:
        self._loaded()
        with self._lock:
            return bool(self._specs.get(op))

    def ops(self) -> list[str]:
        self._loaded()
        with self._lock:
            return sorted(op for op, specs in self._specs.items() if specs)

    def all_specs(self) -> list[KernelSpec]:
        return [spec for op in self.ops() for spec in self.get(op)]


# What the plug-ins registered, and how loading them went, describe the program this process runs, as the registry
# does: not state that clear_cache() or a fresh test state forgets (a plug-in's hook runs once per process).
# Its lock is state.process.locks.plugins, so that a forked child gets a new one.
_plugins_loaded = False
_loading = threading.local()  # .plugin, .added: the entry point whose hook runs on this thread, what it registered
plugin_errors: dict[str, str] = {}  # entry point -> why its hook raised: nothing of it is registered
plugin_conflicts: dict[str, str] = {}  # entry point -> its registrations that conflicted, skipped (its others kept)


_listeners: list[Callable[[str], None]] = []


def on_register(listener: Callable[[str], None]) -> None:
    """Call `listener(op)` after each new spec or op definition any registry takes (the selector forgets that op's
    kernels)."""
    _listeners.append(listener)


def _differences(current, new) -> tuple[list[str], list[str]]:
    """"field old, now new" for each dataclass field that differs, and the names of the fields whose two values
    are one function made twice (a lambda or closure is created anew by each call, and equal only to itself)."""
    parts, remade = [], []
    for name in (f.name for f in dataclasses.fields(new)):
        old, now = getattr(current, name), getattr(new, name)
        if old == now:
            continue
        if inspect.isfunction(old) and inspect.isfunction(now) and old.__code__ == now.__code__:
            remade.append(name)
            parts.append(f"{name} the same code as a new function object ({_show(now)}), equal only to itself")
            continue
        shown = _show(old), _show(now)
        if shown[0] == shown[1] and inspect.isfunction(old) and inspect.isfunction(now):  # two lambdas, say
            shown = tuple(f"{text} (line {f.__code__.co_firstlineno})" for text, f in zip(shown, (old, now)))
        parts.append(f"{name} {shown[0]}, now {shown[1]}")
    return parts, remade


def _show(value: Any) -> str:
    if inspect.isfunction(value):  # its repr differs by address alone
        return f"{value.__module__}:{value.__qualname__}"
    if isinstance(value, enum.Enum):
        return repr(value.value)
    return repr(value)


def _op_conflict(current: OpDefinition, new: OpDefinition) -> ValueError:
    differ, remade = _differences(current, new)
    advice = []
    if remade:
        kind, objects = ("a module-level function", "object") if len(remade) == 1 else ("module-level functions",
                                                                                          "objects")
        advice.append(f"define {' and '.join(remade)} as {kind} rather than a lambda or closure, so that calling "
                      f"register_op again passes the same {objects} and is a no-op")
    if len(differ) > len(remade):  # something other than a function made again differs
        advice.append("define each op once, or use an op name of your own (e.g. 'myengine.rmsnorm')")
    return ValueError(f"Conflicting op definition for {new.op!r}: register_op was already called for it with "
                      f"{'; '.join(differ)}; {'; '.join(advice)}")


def _journal(target: KernelRegistry, registered: KernelSpec | OpDefinition) -> None:
    """Note a registration made inside a plug-in's hook, so that it can be undone if the hook raises."""
    added = getattr(_loading, "added", None)
    if added is not None:
        added.append((target, registered))


def _conflict(current, error: ValueError):
    """Raise `error` at the caller's registration; inside a plug-in's hook, note it and keep the first
    registration, so one conflicting spec does not cost the plug-in its other registrations."""
    plugin = getattr(_loading, "plugin", None)
    if plugin is None:
        raise error
    note = f"ValueError: {error}"
    plugin_conflicts[plugin] = f"{plugin_conflicts[plugin]}; {note}" if plugin in plugin_conflicts else note
    log.warning("autosel.ops entry point %r: %s; that registration is skipped, its others are kept", plugin, error)
    return current


def _is_autosels_own(entry: importlib.metadata.EntryPoint) -> bool:
    dist = getattr(entry, "dist", None)
    return dist is not None and (dist.name or "").lower() == "autosel"


def load_plugins() -> None:
    """Run every `autosel.ops` entry point once per process, autosel's own first (the first registration of an
    (op, backend) is kept, so the built-ins win whatever order importlib.metadata lists the packages in); a
    broken plug-in is logged, not fatal, and what its hook registered before raising is undone."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    with state.process.locks.plugins:  # re-entered by the hooks themselves: they register into the registry
        if _plugins_loaded or hasattr(_loading, "plugin"):  # a hook registering: the load is under way
            return
        try:
            entries = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
            for entry in sorted(entries, key=lambda e: not _is_autosels_own(e)):  # stable: others keep their order
                _loading.plugin, _loading.added = entry.name, []
                try:
                    hook: Any = entry.load()
                    if callable(hook):
                        hook()
                except Exception as exc:  # one bad plug-in must not hide the others' kernels
                    # Half a plug-in would leave ops without their definitions, or a reference without its op.
                    for target, registered in reversed(_loading.added):
                        target._forget(registered)
                    failure = f"{type(exc).__name__}: {exc}"
                    noted = plugin_conflicts.pop(entry.name, None)  # undone with the rest
                    plugin_errors[entry.name] = f"{failure}; {noted}" if noted else failure
                    log.warning("autosel.ops entry point %r (%s) failed: %s; its ops are not registered (the %d "
                                "registrations it made before failing are undone)",
                                entry.name, entry.value, failure, len(_loading.added))
        finally:
            for name in ("plugin", "added"):
                if hasattr(_loading, name):
                    delattr(_loading, name)
            _plugins_loaded = True


registry = KernelRegistry(load=load_plugins)


def _after_fork_in_child() -> None:
    # A lock another thread of the parent held at the fork would be held for good in the child.
    registry._lock = threading.RLock()


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)

# AUTOSEL_BACKEND's op names are checked against this registry's (read at the time: a test may swap it).
config.set_registered_ops(lambda: registry.ops())


def register_kernel(spec: KernelSpec) -> KernelSpec:
    if not isinstance(spec, KernelSpec):
        raise TypeError(f"register_kernel takes a KernelSpec, got {spec!r} ({type(spec).__name__}); write "
                        "register_kernel(KernelSpec('layernorm.rmsnorm', 'torch', 'mypkg.norm:rmsnorm'))")
    return registry.register(spec)


def register_op(
    op: str,
    *,
    shapes: Any,
    make_inputs: Callable[[dict, str], tuple],
    reference: KernelBackend | str | Callable[..., Any] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    shape_of: Callable[..., dict] | None = None,
    bucket: Callable[..., tuple] | None = None,
    route_key: int | tuple[int, int] | None = None,
    signature: str = "",
    traced: str | Callable[[str, Callable[..., Any]], Callable[..., Any]] | None = None,
    activations: tuple[int, ...] = (0,),
    weights: tuple[int, ...] = (),
    planned: bool = False,
) -> OpDefinition:
    """Declare what tuning `op` needs. `reference` defaults to the op's torch backend. `bucket(*args)`: the
    shape bucket of a call, a tuple such as (tokens rounded to a power of two, hidden); with it, each
    bucket the shapes cover gets its own decision and get_kernel dispatches by bucket; `route_key`: the index
    of a positional argument whose shape alone decides the bucket (a faster dispatch). `signature` documents
    how the op is called (shown by `autosel doctor`). `traced(backend, kernel)`: what torch.compile calls in
    place of a kernel it cannot trace, such as a torch custom op around it (OpDefinition.traced). `activations`:
    the positional arguments the ops before it have just written in a model (OpDefinition.activations);
    `weights`: those a model reads from memory at every call, such as a layer's weight (OpDefinition.weights).
    `planned`: the op's kernels are plan classes, built once per batch and run many times (autosel.planned)."""
    if isinstance(reference, str) and ":" in reference:  # a kernel target's form; registering imports nothing
        raise ValueError(f"reference for op {op!r} is {reference!r}: pass the function itself, or the name of a "
                         "backend registered for the op (such as 'torch') to compare with that backend")
    if isinstance(reference, str):
        reference = KernelBackend.parse(reference)
    if not callable(shapes):
        if isinstance(shapes, Mapping):  # one shape given bare: iterating it blamed its first key
            raise TypeError(f"shapes for op {op!r} must be a list of dicts, got one dict {shapes!r}: pass "
                            f"[{shapes!r}]")
        if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
            raise TypeError(f"shapes for op {op!r} must be a list of dicts such as [{{'tokens': 64}}] or a function "
                            f"of the platform, got {shapes!r}")
        shapes = tuple(dict(s) for s in check_shapes(op, list(shapes)))
        if not shapes:  # it failed only when a tune came to time the op
            raise ValueError(f"shapes for op {op!r} is empty: give at least one representative shape, such as "
                             "[{'tokens': 64}]")
    return registry.define(
        OpDefinition(op=op, shapes=shapes, make_inputs=make_inputs, reference=reference, rtol=rtol, atol=atol,
                     shape_of=shape_of, bucket=bucket, route_key=route_key, signature=signature, traced=traced,
                     activations=tuple(activations) if isinstance(activations, list) else activations,
                     weights=tuple(weights) if isinstance(weights, list) else weights, planned=bool(planned))
    )
