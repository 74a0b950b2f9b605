"""The hot path: a dispatcher that sends each call to its shape bucket's winner, and the AUTOSEL_RECORD recorder.

Everything is resolved when a dispatcher is built (mode, bucket table, loaded kernels); a call costs one shape
read and one dict lookup (with a route key; else the op's bucket function and a lookup) and the kernel's own
call. A call never times, never reads the DB, never
takes a lock. A bucket that was not tuned goes once through `BucketTable.route` (the nearest tuned bucket,
else the op-level winner) and is then remembered in the lookup dict.

Under torch.compile the dispatcher is traced through another function (`traced`, registered with
torch.compiler.substitute_in_graph): the lookup dict specialised the compiled code on every token count it met
(torch.compile's recompile limit, 8, then failed `fullgraph=True` at the ninth), where `traced` compares the
call's token count with the edges of the runs of token buckets that share a winner, so compiled code is
specialised once per run.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import json
import logging
import operator
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from autosel import state
from autosel.buckets import NEAREST_WITHIN, TracedTokens, first_tokens, log_gaps
from autosel.decisions import bucket_key_rule, bucket_problem, is_number, key_order
from autosel.files import open_regular
from autosel.spec import shape_problem

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BucketTable:
    """One op's decisions in one mode: the op-level winner and each tuned bucket's winner (backend names)."""

    op: str
    mode: str
    default: str
    winners: Mapping[tuple, str] = field(default_factory=dict)

    @property
    def uniform(self) -> bool:
        """True when every bucket has the op-level winner: get_kernel then returns the plain kernel."""
        return all(w == self.default for w in self.winners.values())

    def nearest(self, key: tuple, within: float = NEAREST_WITHIN) -> tuple | None:
        """The tuned bucket nearest to `key` (the least sum of log_gaps; ties to the smaller bucket) among those
        within a factor of two in every number (`within`, a log2 gap: NEAREST_WITHIN), or None."""
        scored = []
        for tuned in self.winners:  # a plain loop: torch.compile(fullgraph=True) traces this on an unseen bucket
            gaps = log_gaps(key, tuned)
            if gaps is not None and max(gaps, default=0.0) <= within:
                scored.append((sum(gaps), key_order(tuned), tuned))
        return min(scored, key=lambda s: s[:2])[2] if scored else None

    def route(self, key: tuple, within: float = NEAREST_WITHIN) -> str:
        """The backend a call in bucket `key` runs: its own winner, the nearest tuned bucket's (within `within`),
        else the op-level winner."""
        if key in self.winners:
            return self.winners[key]
        near = self.nearest(key, within)
        return self.winners[near] if near is not None else self.default


def token_runs(table: BucketTable, before: tuple, after: tuple, up: bool = False) -> tuple[tuple[int, str], ...]:
    """For the bucket keys (*before, token bucket, *after), the backend each token count runs, as runs: (the
    least token count of the run, backend), largest first; up: token_bucket_up's buckets. Past twice the largest
    tuned token bucket no tuned bucket is near (NEAREST_WITHIN), so the last run goes on for ever."""
    at = len(before)
    tuned = [k[at] for k in table.winners if len(k) == at + 1 + len(after) and is_number(k[at])]
    top, bucket, runs = max(tuned, default=1), 1, []
    while bucket <= 4 * top:
        backend = table.route((*before, bucket, *after))
        if not runs or runs[-1][1] != backend:
            runs.append((first_tokens(bucket, up), backend))
        bucket *= 2
    return tuple(reversed(runs))


def _substitute() -> Callable | None:
    """torch.compiler.substitute_in_graph, or None without torch (nothing to compile) or before torch 2.5. One
    that torch refuses (another library gave the function a stand-in first, say) is logged and left out: the
    function is then traced as it is, which costs compiles, never a call."""
    if "torch" not in sys.modules:
        return None
    import torch

    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if substitute is None:
        return None

    def register(original: Callable[..., Any], stand_in: Callable[..., Any]) -> None:
        try:
            substitute(original, skip_signature_check=True)(stand_in)
        except Exception as exc:  # torch's own checks: TypeError, ValueError and more across its versions
            log.debug("torch.compile will trace %r as it is: %s", original, exc)
    return register


# The ids of the kernels trace_as has given a stand-in (kept alive by their modules). Not in autosel.state: torch
# keeps each stand-in for the process, so this mirrors torch's registry, which neither clear_cache nor a test resets.
_traced_as: set[int] = set()

# Giving torch.compile a stand-in imports torch._dynamo (2.1 s on this project's CPU machine, torch._inductor with
# it): on the H200 that import was most of a Triton winner's first get_kernel, 3.0-3.4 s against gemm.mm's 72 ms
# (results/startup-cuda-sm-90-nvidia-h200-132-2026-12-05T134007.json). A process that has not imported it compiles
# nothing yet, so the stand-ins wait here and are given when it is imported (_DynamoWatch), before anything is
# compiled. Like _traced_as, a mirror of what torch keeps for the process: not in autosel.state.
_pending: list[Callable[[], None]] = []
_pending_lock = threading.Lock()


def _when_compiling(give: Callable[[], None]) -> None:
    """Run `give` (it hands torch.compile a stand-in) now if torch._dynamo is imported, else once it is."""
    if "torch._dynamo" in sys.modules:
        give()
        return
    with _pending_lock:
        _pending.append(give)
        if not any(isinstance(finder, _DynamoWatch) for finder in sys.meta_path):
            sys.meta_path.insert(0, _DynamoWatch())


def _give_pending(*_callback_args: Any) -> None:
    """Run the pending gives, each left pending if it raises (then the next compile's start tries it again)."""
    with _pending_lock:
        gives = list(_pending)
    for give in gives:
        give()
        with _pending_lock:
            _pending.remove(give)


class _DynamoWatch(importlib.abc.MetaPathFinder):
    """Finds nothing of its own: has torch._dynamo's import give the pending stand-ins when it ends."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch._dynamo" or getattr(self, "seen", False):
            return None
        self.seen = True
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # the other finders find it; the stand-ins wait for the next get_kernel that needs one
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            try:
                _give_pending()
            except Exception as exc:  # noqa: BLE001 - e.g. torch._inductor half imported: at the first compile
                log.debug("stand-ins for torch.compile given at its first compile instead: %s", exc)
                module.callback_handler.register_start_callback(_give_pending)

        spec.loader.exec_module = exec_module
        return spec


def trace_as(kernel: Callable[..., Any], traced: Callable[..., Any]) -> None:
    """Have torch.compile call `traced` (a torch custom op around `kernel`, autosel.ops.opaque) wherever it meets
    `kernel`, for a kernel get_kernel returns as it is. Eager calls of `kernel` are untouched."""
    substitute = _substitute()
    if traced is kernel or substitute is None or id(kernel) in _traced_as:
        return

    def call(*args, **kwargs):
        return traced(*args, **kwargs)

    _traced_as.add(id(kernel))
    _when_compiling(lambda: substitute(kernel, call))


def _trace_as_runs(dispatch: Callable[..., Any], table: BucketTable, kernels: Mapping[str, Callable[..., Any]],
                   bucket: Callable[..., tuple], eager_parts: list[Callable[..., Any]]) -> None:
    """Have torch.compile trace `traced` wherever it meets `dispatch`. Nothing without torch (nothing to compile).

    `traced` calls the bucket function's `traced` attribute when it has one: the same key with the token count
    as TracedTokens(count) in place of its token bucket (the built-in ops' bucket functions have it). Without
    one, the compiled code is specialised on whatever the bucket function reads, as any Python code is.

    A kernel torch.compile cannot trace (flashinfer's, commit bb67fd6, unless `traced` gives a custom op for it)
    breaks the graph, and the call then runs `dispatch` itself; torch.compile would compile its frames
    (`eager_parts`) once per token count as new code, so they are marked to run as they are."""
    substitute = _substitute()
    if substitute is None:  # torch before 2.5: the lookup is traced, once per token count
        return
    _when_compiling(lambda: _give_runs(substitute, dispatch, table, kernels, bucket, eager_parts))


def _give_runs(substitute: Callable, dispatch: Callable[..., Any], table: BucketTable,
               kernels: Mapping[str, Callable[..., Any]], bucket: Callable[..., tuple],
               eager_parts: list[Callable[..., Any]]) -> None:
    import torch

    try:
        from torch._dynamo.eval_frame import skip_code
    except ImportError:  # a torch without it: the fallback's frames are compiled, as before
        skip_code = None
    for part in eager_parts if skip_code is not None else ():
        skip_code(part.__code__)

    # Run in Python on constants while tracing, their answers enter no graph; and `traced` may close over
    # functions, dicts and strings only (dynamo wraps what it meets there, and cannot wrap a BucketTable).
    @torch.compiler.assume_constant_result
    def route(key: tuple) -> str:
        return table.route(key)

    @torch.compiler.assume_constant_result
    def runs(before: tuple, after: tuple, up: bool) -> tuple[tuple[int, str], ...]:
        return token_runs(table, before, after, up)

    kernels = dict(kernels)

    key_of = getattr(bucket, "traced", bucket)

    def traced(*args, **kwargs):
        # operator.index of a size torch.compile traces symbolically (a width, with dynamic=True) specialises the
        # code on it, as int() does not: routes are looked up on constants.
        key = tuple(operator.index(part) if type(part) is int else part for part in key_of(*args, **kwargs))
        at = next((i for i, part in enumerate(key) if isinstance(part, TracedTokens)), None)
        if at is None:  # a bucket function without a traced variant: specialised on its whole key
            return kernels[route(key)](*args, **kwargs)
        tokens = key[at].count
        for start, backend in runs(key[:at], key[at + 1:], key[at].up):
            if tokens >= start:
                return kernels[backend](*args, **kwargs)
        raise AssertionError("token_runs ends with a run from 0 tokens")

    substitute(dispatch, traced)


# Distinct shapes a dispatcher with a route key remembers; past this, calls compute their bucket every time.
MAX_ROUTES = 1 << 16


# What a bucket function raises on arguments it cannot read: a list for a tensor, a weight of another rank.
_UNREADABLE = (AttributeError, TypeError, ValueError, IndexError)


def _unreadable_call(op: str, args: tuple, kwargs: Mapping[str, Any], exc: Exception) -> Exception:
    """The error for a call whose bucket its dispatcher cannot read (a list where a tensor goes, a weight of
    another rank): the op, what was passed and the op's signature, in place of the bucket function's own
    AttributeError or unpacking error. A TypeError for a value that is no tensor, else a ValueError."""
    from autosel.registry import registry

    definition = registry.definition(op)
    takes = f"; {op} takes {definition.signature}" if definition is not None and definition.signature else ""
    kind = TypeError if isinstance(exc, (AttributeError, TypeError)) else ValueError
    return kind(f"{op}: the call's shape bucket cannot be read from its {_describe(args, kwargs)}: "
                f"{type(exc).__name__}: {exc}{takes}")


def dispatcher(table: BucketTable, kernels: Mapping[str, Callable[..., Any]], bucket: Callable[..., tuple],
               route_key: int | tuple[int, int] | None = None,
               traced: Mapping[str, Callable[..., Any]] | None = None) -> Callable[..., Any]:
    """A callable that runs each call on its bucket's winner; `kernels` maps every backend the table names to
    its loaded kernel. The plain kernel when the table is uniform (no added cost). `traced`: what torch.compile
    calls in place of each kernel (OpDefinition.traced_kernel), by backend; default the kernels.

    route_key: the index of a positional argument whose shape alone decides the bucket (0 for the row-wise
    ops), or two such indices ((0, 1) for gemm.mm). Calls are then looked up by those shapes, and the bucket
    function runs once per distinct shape instead of on every call (about 0.2 us less a call on this
    project's CPU).
    """
    if table.uniform:
        return kernels[table.default]
    by_bucket: dict[tuple, Callable[..., Any]] = {k: kernels[b] for k, b in table.winners.items()}
    find = by_bucket.get

    def unseen(key: tuple) -> Callable[..., Any]:
        problem = bucket_problem(key)  # a key the tune never saw: checked as the tune checks its keys
        if problem:  # None, say, for calls the bucket function does not cover (it said: "NoneType has no len()")
            raise ValueError(f"{table.op}: {bucket_key_rule(key, problem)}")
        backend = table.route(key)  # no logging here: torch.compile(fullgraph=True) must trace this path
        by_bucket[key] = kernels[backend]  # one dict store under the GIL: later calls take the fast path
        return by_bucket[key]

    def key_of(args: tuple, kwargs: dict) -> tuple:  # the bucket function, its failures said in the op's words
        try:
            return bucket(*args, **kwargs)
        except _UNREADABLE as exc:
            raise _unreadable_call(table.op, args, kwargs, exc) from exc

    def by_bucket_of(*args, **kwargs):
        key = key_of(args, kwargs)
        return (find(key) or unseen(key))(*args, **kwargs)

    eager_parts = [unseen, by_bucket_of, key_of]
    if route_key is None:
        def dispatch(*args, **kwargs):
            if kwargs:
                return by_bucket_of(*args, **kwargs)
            try:  # free unless it raises (Python 3.11's exception tables)
                key = bucket(*args)  # positional calls (the common case) skip passing an empty dict twice: ~40 ns
            except _UNREADABLE as exc:
                raise _unreadable_call(table.op, args, {}, exc) from exc
            return (find(key) or unseen(key))(*args)
    else:
        routes: dict[Any, Callable[..., Any]] = {}
        route = routes.get
        first, second = (route_key, None) if isinstance(route_key, int) else route_key
        last = max(first, -1 if second is None else second)

        def learn(args: tuple, shapes) -> Callable[..., Any]:
            key = key_of(args, {})
            fn = find(key) or unseen(key)
            if len(routes) < MAX_ROUTES:
                routes[shapes] = fn
            return fn

        eager_parts.append(learn)

        if second is None:
            def dispatch(*args, **kwargs):
                if kwargs or len(args) <= last:
                    return by_bucket_of(*args, **kwargs)
                try:  # free unless it raises (Python 3.11's exception tables)
                    shape = args[first].shape
                except AttributeError as exc:  # no tensor there
                    raise _unreadable_call(table.op, args, {}, exc) from exc
                return (route(shape) or learn(args, shape))(*args)
        else:
            def dispatch(*args, **kwargs):
                if kwargs or len(args) <= last:
                    return by_bucket_of(*args, **kwargs)
                try:
                    shapes = (args[first].shape, args[second].shape)
                except AttributeError as exc:
                    raise _unreadable_call(table.op, args, {}, exc) from exc
                return (route(shapes) or learn(args, shapes))(*args)

    _trace_as_runs(dispatch, table, traced or kernels, bucket, [dispatch, *eager_parts])
    dispatch.__name__ = dispatch.__qualname__ = f"autosel_dispatch[{table.op}]"
    dispatch.__doc__ = (f"autosel's dispatcher for {table.op} ({table.mode} mode): each shape bucket runs its "
                        f"own winner; op-level winner {table.default}.")
    dispatch.table = table  # type: ignore[attr-defined]
    dispatch.kernels = dict(kernels)  # type: ignore[attr-defined]
    # torch keeps every dispatcher given a stand-in (_trace_as_runs) for the process: get_kernel empties the
    # shapes one learned when it lets it go, so what stays is its table and kernels.
    dispatch.forget_shapes = routes.clear if route_key is not None else (lambda: None)  # type: ignore[attr-defined]
    return dispatch


# --- AUTOSEL_RECORD: each new shape of an op appended once per process, never in the way of the call ---------
# What the recorder remembers (shapes appended, files and ops it stopped for) is state.process.recorder.


def by_tokens(eager: Callable[..., Any], graph: Callable[..., Any], threshold: int) -> Callable[..., Any]:
    """A kernel that runs `graph` (get_kernel(op, mode="graph")) on calls of at least `threshold` tokens and `eager`
    on shorter ones; `eager` itself when the two are one kernel. For an engine that runs its prefill eagerly: a long
    prefill keeps the GPU behind the host, so its calls cost their device time, which the graph decisions are made
    on. The tokens are the first argument's first dimension, as in every built-in op (rope: the positions); keyword
    arguments are passed on. Its `parts` are (eager, graph, threshold)."""
    # by_tokens(e, g, "1024") was accepted and failed at its first call with a TypeError; 0 ran graph on every call.
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise TypeError(f"by_tokens: threshold is {threshold!r} ({type(threshold).__name__}); pass the token count "
                        "from which `graph` runs, an int such as 1024")
    if threshold < 1:
        raise ValueError(f"by_tokens: threshold is {threshold}; pass a token count of at least 1 (every call has "
                         "at least one token, so a smaller one always runs `graph`: pass that kernel itself instead)")
    for name, fn in (("eager", eager), ("graph", graph)):
        if not callable(fn):
            raise TypeError(f"by_tokens: {name} is {fn!r}, not a kernel; pass get_kernel(op, mode={name!r})")
    if graph is eager:
        return eager

    def kernel(*args, **kwargs):
        if kwargs:  # a branch of its own: positional calls skip passing an empty kwargs dict on
            return (graph if args[0].shape[0] >= threshold else eager)(*args, **kwargs)
        return (graph if args[0].shape[0] >= threshold else eager)(*args)
    kernel.parts = (eager, graph, threshold)
    return kernel


def recording(op: str, fn: Callable[..., Any], path, mode: str, shape_of: Callable[..., dict] | None
              ) -> Callable[..., Any]:
    """Wrap `fn` so each new shape of `op` (shape_of) is appended to `path` once per process, after a call
    that returned. Recording never breaks the call: a path that cannot be written is warned about once and
    recording stops; a shape_of that raises or returns what is no shape (spec.shape_problem) is warned about once
    and that op alone stops being recorded (one op's bad shape_of must not cost the others' shapes). Calls that
    torch.compile traces are not recorded (is_compiling() is True while it traces, so the file writes never enter
    the graph and fullgraph=True holds); eager calls are."""
    if shape_of is None:
        said = state.process.recorder.no_shape_of_said
        if op not in said:
            said.add(op)
            log.warning("AUTOSEL_RECORD: op %r declares no shape_of (register_op(..., shape_of=fn): the call's "
                        "arguments -> its shape dict), so its calls are not recorded", op)
        return fn
    import torch

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        result = fn(*args, **kwargs)
        recorder = state.process.recorder
        if (not is_compiling() and str(path) not in recorder.broken_paths
                and recorder.broken_ops.get(op) is not shape_of):
            _record(op, mode, shape_of, args, kwargs, path)
        return result

    return recorded


def _record(op: str, mode: str, shape_of: Callable[..., dict], args, kwargs, path) -> None:
    try:
        result = shape_of(*args, **kwargs)
    except Exception as exc:  # a shape_of that fails on this call: say so once, keep the call's result
        _stop_recording_op(op, shape_of,
                           f"raised {type(exc).__name__}: {exc} on a call with {_describe(args, kwargs)}")
        return
    problem = shape_problem(result)  # what register_op says of a declared shape
    if problem:  # written, the line would make `autosel tune --from-record` refuse the whole file
        _stop_recording_op(op, shape_of, f"returned a shape that {problem}")
        return
    shape = json.dumps(dict(result), sort_keys=True)  # dict(): json cannot write other mappings
    recorder = state.process.recorder
    if (op, mode, shape) in recorder.recorded:
        return
    with recorder.lock:
        if (op, mode, shape) in recorder.recorded:
            return
        try:
            # A missing folder was warned of at the first call, where AUTOSEL_DB's is created: AUTOSEL_RECORD's too.
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open_regular(path, "a", encoding="utf-8") as f:  # appending to a FIFO waits for a reader
                f.write(json.dumps({"op": op, "shape": json.loads(shape), "mode": mode}) + "\n")
        except OSError as exc:
            _stop_recording(path, f"cannot append to {path}: {exc}")
            return
        recorder.recorded.add((op, mode, shape))


def _stop_recording(path, why: str) -> None:
    import warnings

    state.process.recorder.broken_paths.add(str(path))
    warnings.warn(f"AUTOSEL_RECORD: {why}; recording stops for this process (the kernels keep running). "
                  "Point AUTOSEL_RECORD at a writable file.", RuntimeWarning, stacklevel=4)


def _describe(args: tuple, kwargs: dict) -> str:
    """A call's arguments in a few words: tensors by their shape, so a warning or error shows which call it was."""
    def one(value) -> str:
        shape = getattr(value, "shape", None)
        return f"a tensor of shape {tuple(shape)}" if isinstance(shape, tuple) else type(value).__name__
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "arguments (" + ", ".join(parts) + ")" if parts else "no arguments"


def _stop_recording_op(op: str, shape_of: Callable[..., Any], why: str) -> None:
    import warnings

    recorder = state.process.recorder
    with recorder.lock:
        if recorder.broken_ops.get(op) is shape_of:  # another thread got there first: warn once
            return
        recorder.broken_ops[op] = shape_of
    name = f"{getattr(shape_of, '__module__', '?')}:{getattr(shape_of, '__qualname__', type(shape_of).__name__)}"
    warnings.warn(f"AUTOSEL_RECORD: shape_of of op {op!r} ({name}) {why}; calls of {op!r} are no longer recorded in "
                  "this process (its kernels keep running, other ops are still recorded). Make shape_of return a "
                  "dict that JSON can hold (strings, numbers, bools, None, lists of them) for every call the op "
                  "takes, such as {'tokens': 64, 'hidden': 4096, 'dtype': 'bfloat16'} (register_op(..., "
                  "shape_of=fn)).", RuntimeWarning,
                  stacklevel=4)
