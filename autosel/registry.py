"""The process-wide registry of kernel specs and op definitions, and the plug-in entry points that fill it.

The process-wide `registry` runs the `autosel.ops` entry points before its first read or registration, so
every reader sees the plug-ins' ops and a user's registration that conflicts with a plug-in's fails at the
user's own call, never inside the plug-in.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import threading
from collections import defaultdict
from typing import Any, Callable, Iterable, Mapping

from autosel.spec import KernelBackend, KernelSpec, OpDefinition

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
                differ = "; ".join(f"{name} {getattr(current, name)!r}, now {getattr(spec, name)!r}"
                                   for name in (f.name for f in dataclasses.fields(spec))
                                   if getattr(current, name) != getattr(spec, name))
                return _conflict(current, ValueError(
                    f"Conflicting kernel registration for op {spec.op!r} backend {spec.backend.value!r}: "
                    f"already registered with {differ}; "
                    "register each (op, backend) once, or register your kernel under an op name of your own "
                    "(e.g. 'myengine.rmsnorm')"
                ))
            existing.append(spec)
            return spec

    def define(self, definition: OpDefinition) -> OpDefinition:
        self._loaded()
        with self._lock:
            current = self._ops.get(definition.op)
            if current is not None and current != definition:
                return _conflict(current, ValueError(
                    f"Conflicting op definition for {definition.op!r}: register_op was already called for it; "
                    "define each op once, or use an op name of your own (e.g. 'myengine.rmsnorm')"
                ))
            self._ops[definition.op] = definition
            return definition

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


_plugins_loaded = False
_plugins_lock = threading.RLock()  # re-entered by the hooks themselves: they register into the registry
_loading = threading.local()  # .plugin: the entry point whose hook is running on this thread
plugin_errors: dict[str, str] = {}


def _conflict(current, error: ValueError):
    """Raise `error` at the caller's registration; inside a plug-in's hook, note it and keep the first
    registration, so one conflicting spec does not cost the plug-in its other registrations."""
    plugin = getattr(_loading, "plugin", None)
    if plugin is None:
        raise error
    note = f"ValueError: {error}"
    plugin_errors[plugin] = f"{plugin_errors[plugin]}; {note}" if plugin in plugin_errors else note
    log.warning("autosel.ops entry point %r: %s; that registration is skipped, its others are kept", plugin, error)
    return current


def load_plugins() -> None:
    """Run every `autosel.ops` entry point once per process; a broken plug-in is logged, not fatal."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _plugins_lock:
        if _plugins_loaded or hasattr(_loading, "plugin"):  # a hook registering: the load is under way
            return
        try:
            for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
                _loading.plugin = entry.name
                try:
                    hook: Any = entry.load()
                    if callable(hook):
                        hook()
                except Exception as exc:  # one bad plug-in must not hide the others' kernels
                    plugin_errors[entry.name] = f"{type(exc).__name__}: {exc}"
                    log.warning("autosel.ops entry point %r (%s) failed: %s: %s; its ops are not registered",
                                entry.name, entry.value, type(exc).__name__, exc)
        finally:
            if hasattr(_loading, "plugin"):
                del _loading.plugin
            _plugins_loaded = True


registry = KernelRegistry(load=load_plugins)


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
) -> OpDefinition:
    """Declare what tuning `op` needs. `reference` defaults to the op's torch backend. `bucket(*args)`: the
    shape bucket of a call, a tuple such as (tokens rounded to a power of two, hidden); with it, each
    bucket the shapes cover gets its own decision and get_kernel dispatches by bucket; `route_key`: the index
    of a positional argument whose shape alone decides the bucket (a faster dispatch). `signature` documents
    how the op is called (shown by `autosel doctor`)."""
    if isinstance(reference, str):
        reference = KernelBackend.parse(reference)
    if not callable(shapes):
        if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
            raise TypeError(f"shapes for op {op!r} must be a list of dicts such as [{{'tokens': 64}}] or a function "
                            f"of the platform, got {shapes!r}")
        shapes = list(shapes)
        for shape in shapes:
            if not isinstance(shape, Mapping):
                raise TypeError(f"each shape of op {op!r} must be a dict such as {{'tokens': 64}}, got {shape!r}")
        shapes = tuple(dict(s) for s in shapes)
    return registry.define(
        OpDefinition(op=op, shapes=shapes, make_inputs=make_inputs, reference=reference, rtol=rtol, atol=atol,
                     shape_of=shape_of, bucket=bucket, route_key=route_key, signature=signature)
    )
