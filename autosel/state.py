"""What this process remembers between calls, in one object: get_kernel's resolved kernels, the ranks' agreed
decisions and set_group's group, deciding's memos (the open tuning DBs, the tunes recorded, what was said once), the
tuning DB's warnings given once, AUTOSEL_RECORD's memory, the fingerprints read from code, and the locks of what is
not state (plug-in loading, the logging handler, torch's custom ops).

`process` is the one ProcessState every module reads, as `state.process` at each use (never imported by name: `use`
swaps it, and get_kernel's warm path reads it with no call); clear_cache() empties its kernels and agreements (not
set_group's group, a setting) and resets what was said, recorded and derived (`forget`); a test swaps the whole
object with `use()` (tests/conftest.py gives each test its own), so two tests never share a cache.

Not here, each with its reason where it lives: the registry and what its plug-ins registered (the program, not a
memo), the facts of the machine read once (platforms: the device and the installed versions), the kernels' own
memos and working memory (ops/), the custom ops and stand-ins torch keeps for the process (ops.opaque, dispatch),
and the DB files open until exit (db).

Fork safety (a serving engine forks its workers after importing autosel, and often after resolving kernels): a
forked child starts from `forked()` of its parent's state, through os.register_at_fork. It keeps the kernels
already resolved, the memos, and what was said, recorded and derived, with new locks, since a lock another thread
of the parent held at the fork would be held for ever in the child, and its first get_kernel would hang (the
registry's lock and KernelBackend.declare's are renewed by their own modules' fork hooks); it forgets the agreed
decisions, set_group's group and the broadcasts under way, since the child is not a rank of the parent's process
group and the threads waiting for those broadcasts do not exist in it. The tuning DB handles it keeps reopen their
files in the child themselves (db.TuningDB checks the process id), as SQLite requires.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable


@dataclass
class KernelCache:
    """get_kernel's resolved kernels (autosel.selector). clear_cache() swaps `kernels` for a new dict, never
    mutating one a reader holds, and bumps a generation, so that a lookup in flight stores nothing stale."""

    kernels: dict[tuple, Callable[..., Any]] = field(default_factory=dict)  # (op, backend, mode) -> kernel
    generation: int = 0  # clear_cache() bumps it
    op_generations: dict[str, int] = field(default_factory=dict)  # ...and a registration for the op, the op's
    traced: dict[tuple, str] = field(default_factory=dict)  # key -> selector's attribute holding it for compiled code
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Agreements:
    """The decisions every rank received from rank 0, the broadcasts under way on this rank, and what the ranks
    have warned about (autosel.distributed)."""

    agreed: dict[tuple, object] = field(default_factory=dict)  # key -> the answer every rank received for it
    flights: dict[tuple, Any] = field(default_factory=dict)  # key -> the broadcast of it under way on this rank
    generation: int = 0  # forget_agreements() during a broadcast: its answer is not kept
    op_generations: dict[str, int] = field(default_factory=dict)  # ...and forget_agreements(op), for that op's
    group: Callable[[], object] = lambda: None  # a weak reference to the process group the answers were agreed in
    # set_group's group (None: torch's default, every rank): a setting, so clear_cache() keeps it; a fork does not,
    # since the child is no rank of that group.
    chosen_group: object | None = None
    chosen_alone: set[str] = field(default_factory=set)  # ops get_kernel resolved with no process group up
    gaps_warned: set[tuple[str, ...]] = field(default_factory=set)  # registration differences warned about
    reported: set[tuple] = field(default_factory=set)  # AUTOSEL_CHECK_RANKS differences warned about
    lock: threading.Lock = field(default_factory=threading.Lock)
    broadcast_lock: threading.Lock = field(default_factory=threading.Lock)  # one broadcast at a time on this rank


@dataclass
class Memos:
    """What deciding remembers (autosel.tuning, autosel.config): the open tuning DBs, the tunes this process
    recorded, and the warnings it gives once."""

    databases: dict[tuple, Any] = field(default_factory=dict)  # (AUTOSEL_DB, AUTOSEL_DB_PATH) -> TuningDB
    tunes_here: dict[Any, int] = field(default_factory=dict)  # DecisionKey -> tunes of it this process recorded
    announced: set[tuple[str, str]] = field(default_factory=set)  # (op, mode) whose run-time tune was warned of
    near_said: set[tuple] = field(default_factory=set)  # near-match rows this process has said it uses
    untimed_said: set[tuple[str, str]] = field(default_factory=set)  # (op, mode) whose outdated decision it keeps
    forced_ops_checked: set[str] = field(default_factory=set)  # AUTOSEL_BACKEND ops checked against the registry
    lock: threading.Lock = field(default_factory=threading.Lock)  # opening a DB


@dataclass
class Said:
    """The tuning DB's warnings given once (autosel.db): given again after clear_cache()."""

    db_conditions: set[tuple[str, str]] = field(default_factory=set)  # (path, condition) db.files.warn_once gave
    bad_rows: set[tuple[str, tuple]] = field(default_factory=set)  # (source, key) of rows logged as unreadable


@dataclass
class Recorder:
    """AUTOSEL_RECORD's memory (autosel.dispatch): the shapes appended, where recording stopped and why."""

    recorded: set[tuple[str, str, str]] = field(default_factory=set)  # (op, mode, shape JSON) appended
    broken_paths: set[str] = field(default_factory=set)  # a file that cannot be written: recording stops for every op
    broken_ops: dict[str, Any] = field(default_factory=dict)  # op -> its shape_of that failed: that op alone stops
    no_shape_of_said: set[str] = field(default_factory=set)  # ops whose missing shape_of was warned of
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Derived:
    """What this process computed from code and could compute again (autosel.staleness): the source files read for
    fingerprints and each one's identity, and each stored shape's bucket as the op's functions key it today."""

    sources: dict[str, Any] = field(default_factory=dict)  # module -> its parsed source, or None (unreadable)
    identities: dict[tuple, str | None] = field(default_factory=dict)  # a target's or function's identity
    is_module: dict[str, bool] = field(default_factory=dict)  # a package's name -> whether it is a submodule
    meta_keys: dict[tuple, tuple | None] = field(default_factory=dict)  # (make_inputs, bucket, shape) -> its key
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Locks:
    """The locks that guard what is not process state (loading the registry's plug-ins, the logging handler, torch's
    custom ops): here so that a forked child gets new ones (ProcessState.forked)."""

    plugins: threading.RLock = field(default_factory=threading.RLock)  # re-entered: hooks register as they run
    log_handler: threading.Lock = field(default_factory=threading.Lock)  # config.log_to_stderr
    custom_ops: threading.Lock = field(default_factory=threading.Lock)  # ops.opaque: one torch op per kernel


@dataclass
class ProcessState:
    """Everything a process remembers between calls; see the module's docstring."""

    kernels: KernelCache = field(default_factory=KernelCache)
    agreements: Agreements = field(default_factory=Agreements)
    memos: Memos = field(default_factory=Memos)
    said: Said = field(default_factory=Said)
    recorder: Recorder = field(default_factory=Recorder)
    derived: Derived = field(default_factory=Derived)
    locks: Locks = field(default_factory=Locks)

    def forget(self) -> None:
        """clear_cache()'s part beyond the kernels and agreements: the warnings given once are given again,
        AUTOSEL_RECORD appends each shape again, and what was derived from code is derived again at its next use."""
        self.said, self.recorder, self.derived = Said(), Recorder(), Derived()
        # Deciding's warnings given once, as the tuning DB's are; not `announced`: a run-time tune is said once per op
        # and mode in a process, however often its caches are cleared (tests/test_selector.py).
        with self.memos.lock:
            self.memos.near_said, self.memos.untimed_said = set(), set()

    def forked(self) -> ProcessState:
        """This state as a forked child starts: kernels, memos and what was said, recorded and derived kept, with new
        locks; no agreements. (The child's memory is its own copy already: only the locks and the agreements must
        not carry over.)"""
        return ProcessState(kernels=replace(self.kernels, lock=threading.Lock()), agreements=Agreements(),
                            memos=replace(self.memos, lock=threading.Lock()), said=self.said,
                            recorder=replace(self.recorder, lock=threading.Lock()),
                            derived=replace(self.derived, lock=threading.Lock()), locks=Locks())


process = ProcessState()  # the state every module of this process reads now


def use(state: ProcessState) -> ProcessState:
    """Make `state` the process's state (a test's fresh one, say); returns the one it replaces."""
    global process
    previous, process = process, state
    return previous


def _after_fork_in_child() -> None:
    use(process.forked())


if hasattr(os, "register_at_fork"):  # POSIX; Windows has no fork
    os.register_at_fork(after_in_child=_after_fork_in_child)
