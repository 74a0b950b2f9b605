"""Many ranks, one decision: when torch.distributed is initialised, rank 0 decides and broadcasts its decision
(the op-level winner and every bucket's), so every rank runs the same kernel by construction (docs/DESIGN.md
section 7).

The first selection of an op with several registered backends in each mode is then a collective, however many
of them are usable on each rank (a rank that sees one or none still takes part, and raises where it cannot run
rank 0's table): every rank must make it, in the same order (engines select their kernels at model
initialisation on every rank), or, with set_group, every rank of that group (a pipeline stage's ranks, say). The
agreed table is kept per (op, mode, platform), so later selections of it (select_kernel, get_kernel with another
backend argument or an explicit mode, inside CUDA-graph capture too) are not collectives, until clear_cache()
forgets it, or a registration for the op (a new backend, its definition) forgets that op's, which every rank must
then do alike; one that lands while the op is being agreed counts as rank 0 says. No first agreement is made
while a CUDA graph is being captured, where a collective would be recorded into the graph.

What each rank would have run on its own (AUTOSEL_CHECK_RANKS) is autosel.rank_check's.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Callable, TypeVar

from autosel import state
from autosel.errors import TuningError
from autosel.registry import registry
from autosel.spec import spec_list

if TYPE_CHECKING:
    from autosel.dispatch import BucketTable

log = logging.getLogger(__name__)
T = TypeVar("T")


def set_group(group: object | None) -> None:
    """Agree in `group` (a torch.distributed process group) instead of every rank: its first rank decides and
    broadcasts to its other ranks. For engines whose ranks select different ops, such as the stages of a pipeline:
    give each stage's ranks their own group, on every rank of it, before selecting. None: back to every rank.
    Agreements made in another group are forgotten. A group goes with its process group: after
    destroy_process_group, call set_group again (selecting in a group that is gone raises TuningError)."""
    if group is not None:
        import torch.distributed as dist

        if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group returns on the ranks outside the group
            raise TypeError(f"set_group was given GroupMember.NON_GROUP_MEMBER: rank {dist.get_rank()} is not in that "
                            "group (dist.new_group returns it on the ranks outside the group); give each rank the "
                            "group it belongs to")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"set_group takes a torch.distributed process group (dist.new_group([...])) or None, "
                            f"got {group!r}")
    state.process.agreements.chosen_group = group


def _world() -> tuple[int, int, object] | None:
    """(this rank in the agreeing group, its size, torch.distributed) when a process group is up with more than one
    rank, else None. The agreeing group: set_group's, else every rank."""
    torch = sys.modules.get("torch")  # never import torch here: a process without it has no process group
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = state.process.agreements.chosen_group
    try:
        world = dist.get_world_size() if group is None else dist.get_world_size(group)
        rank = dist.get_rank() if group is None else dist.get_rank(group)
    except (ValueError, RuntimeError) as exc:  # torch: "Group ... is not registered"
        raise TuningError("the process group given to autosel.distributed.set_group is gone (destroyed with the "
                          "process group it belonged to?); call set_group again with a group of the current one, or "
                          f"set_group(None) to agree across every rank ({exc})") from exc
    if rank < 0:
        raise TuningError(f"rank {dist.get_rank()} is not in the process group given to "
                          "autosel.distributed.set_group: give each rank a group it belongs to")
    return (rank, world, dist) if world > 1 else None


def _agreeing(dist) -> tuple[object, int]:
    """The group the ranks agree in and the global rank of its first rank, which decides."""
    group = state.process.agreements.chosen_group
    return (dist.group.WORLD, 0) if group is None else (group, dist.get_global_rank(group, 0))


def rank_and_size() -> tuple[int, int] | None:
    """(this rank in the agreeing group, its size) when a process group of more than one rank is up, else None."""
    world = _world()
    return None if world is None else world[:2]


def in_process_group() -> bool:
    """True when a process group of more than one rank is up: a decision made now is rank 0's."""
    return _world() is not None


# The agreed answers, the broadcasts under way, their generations and locks: the process state's Agreements
# (autosel.state), which a forked child starts without.


class _Flight:
    """One broadcast under way: threads of this rank asking for the same key wait for its answer (or error)."""

    def __init__(self) -> None:
        self.done, self.answer, self.error, self.kept = threading.Event(), None, None, False


def forget_agreements(op: str | None = None) -> None:
    """Forget every agreed answer (selector.clear_cache), or those of `op` only (a backend registered for it): the
    next selection of each op forgotten is a collective again, so every rank must forget alike."""
    agreements = state.process.agreements
    with agreements.lock:
        if op is None:
            agreements.agreed.clear()
            agreements.generation += 1
        else:
            for key in [key for key in agreements.agreed if key[0] == op]:
                del agreements.agreed[key]
            agreements.op_generations[op] = agreements.op_generations.get(op, 0) + 1


_local = threading.local()  # .kernels: while this thread makes rank 0's decision of an op (_broadcast), a dict


def deciding() -> bool:
    """Whether this thread is making rank 0's decision of an op for the ranks. A selection made meanwhile (a
    backend's own get_kernel while it is checked or timed) is decided here alone, since the other ranks wait in
    that op's broadcast and cannot make another: it is sent with the op's answer and agreed with it (agree), and
    get_kernel keeps its kernel for the decision only (decision_kernels). (It was a broadcast under a lock this
    thread held: a hang.) Per thread: a backend that selects from a thread of its own while it is timed still
    waits on that lock, for good if this thread waits for that one; autosel's tuner runs candidates on the
    calling thread."""
    return decision_kernels() is not None


def agreement_kept() -> bool | None:
    """Whether the last agreement this thread made, since it last asked, is kept on every rank (rank 0's word), and
    so may be cached alike everywhere: True or False, or None where it made none (no process group, a choice of its
    own under capture or while deciding). Asking clears it."""
    kept, _local.kept = getattr(_local, "kept", None), None
    return kept


def decision_kernels() -> dict | None:
    """While this thread makes rank 0's decision of an op, get_kernel's cache for what it selects meanwhile, dropped
    with the decision (a sub-op selected on every call of a timed backend would otherwise be selected again each
    time, 60-130 us); None otherwise."""
    return getattr(_local, "kernels", None)


def _stamp_locked(agreements: state.Agreements, key: tuple) -> tuple[int, int]:
    """What rank 0 compares when a broadcast of `key` begins and before it sends the answer: a forget_agreements()
    meanwhile keeps the answer out, on every rank."""
    return agreements.generation, agreements.op_generations.get(key[0], 0)


def agree(decide: Callable[[], T], *, what: str, key: tuple, in_capture: bool = False) -> T:
    """Run `decide` on rank 0 and give its answer (any picklable value) to every rank, once per `key` and process
    group: later calls return the agreed answer without a collective, and threads of one rank asking for one key
    at once make one broadcast (the others take its answer). Broadcasts of different keys on one rank go one at
    a time, each naming its op: a rank that received another op's answer than it asked for (ranks selecting in
    different orders) raises rather than run it. Any exception on rank 0 reaches every rank: the contract's
    KeyError and ValueError as themselves, anything else as a TuningError naming it, so no rank is left waiting
    in the broadcast; errors are not kept. Whether the answer is kept is rank 0's call, sent with it: a
    forget_agreements() on rank 0 while it decided drops it on every rank; one that lands while the answer is sent
    or awaited does not (a registration that lands during the broadcast on some ranks only would otherwise leave
    one rank selecting again, with a collective the others do not make). What rank 0 selects while it decides
    (a backend's own sub-op) is decided there alone and sent with the answer, and agreed with it. Whether the
    answer is kept is also left for this thread's next agreement_kept(). key: a tuple whose first item is the op
    (forget_agreements(op) drops the keys of that op)."""
    world = _world()
    if world is None:
        return decide()
    group = _agreeing(world[2])[0]
    nested = deciding()  # selected while rank 0 decides another op: the other ranks wait in that op's broadcast
    agreements = state.process.agreements
    with agreements.lock:
        if agreements.group() is not group:  # a new process group (an elastic restart): nothing agreed in the old one
            agreements.agreed.clear()
            agreements.group = weakref.ref(group)
            _say_chosen_alone(world, agreements.chosen_alone)
        if key in agreements.agreed:
            _local.kept = True
            return agreements.agreed[key]  # type: ignore[return-value]
        flight = None if in_capture or nested else agreements.flights.get(key)
        mine = flight is None and not in_capture and not nested
        if mine or nested:
            stamp = _stamp_locked(agreements, key)
        if mine:
            flight = agreements.flights[key] = _Flight()
    if nested:
        answer = decide()
        _local.nested[key] = (answer, stamp)
        return answer
    if in_capture:  # no collective may be recorded into the graph: this rank's own answer
        return decide()
    if not mine:
        flight.done.wait()
        if flight.error is not None:
            raise flight.error
        _local.kept = flight.kept
        return flight.answer  # type: ignore[return-value]

    def keep(nested: dict) -> tuple[bool, dict]:
        """Rank 0's, when it sends its answer: kept unless forget_agreements() came while it decided (the answer may
        then predate a registration), and with it the answers it selected meanwhile, each unless forgotten since.
        One that lands while the answer is being sent is ignored on every rank: one rank dropping the answer alone
        would select again with a collective the others do not make."""
        with agreements.lock:
            if stamp != _stamp_locked(agreements, key):
                return False, {}
            return True, {k: answer for k, (answer, began) in nested.items() if began == _stamp_locked(agreements, k)}

    try:
        with agreements.broadcast_lock:
            flight.answer, flight.kept, nested_answers = _broadcast(decide, what, world, keep)
        if flight.kept:  # as rank 0 said when it sent it, whatever was forgotten here since: every rank alike
            with agreements.lock:
                agreements.agreed.update(nested_answers)
                agreements.agreed[key] = flight.answer
        _local.kept = flight.kept
        return flight.answer  # type: ignore[return-value]
    except BaseException as exc:
        flight.error = exc
        raise
    finally:
        with agreements.lock:
            agreements.flights.pop(key, None)
        flight.done.set()


def _say_chosen_alone(world: tuple, chosen_alone: set[str]) -> None:
    """Warn once per process group about kernels get_kernel resolved before the group was up (Agreements'
    chosen_alone, noted through tuning.cached_alone): this rank's own choices, cached, which the other ranks may
    not share."""
    if chosen_alone:
        log.warning("rank %d of %d: get_kernel resolved %s before the process group was up, from this rank's own "
                    "decisions, and keeps them (the other ranks may run others); call autosel.clear_cache() on "
                    "every rank after init_process_group, or select kernels only after it", world[0], world[1],
                    ", ".join(repr(op) for op in sorted(chosen_alone)))


def _broadcast(decide: Callable[[], T], what: str, world: tuple,
               keep: Callable[[dict], tuple[bool, dict]]) -> tuple[T, bool, dict]:
    """Rank 0's answer, whether every rank keeps it, and the answers rank 0 selected while it decided, agreed with
    it (rank 0's keep(), sent with the answer)."""
    rank, size, dist = world
    group, src = _agreeing(dist)
    message: list[object] = [None]
    if rank == 0:
        registered = _registrations()  # sent with the answer, so that a rank registering others can say so
        try:
            _local.kernels, _local.nested = {}, {}
            answer = decide()
            kept, nested = keep(_local.nested)
        except BaseException as exc:  # every failure travels, or the other ranks wait forever
            message[0] = ("error", what, registered, type(exc).__name__, str(exc.args[0] if exc.args else exc))
            dist.broadcast_object_list(message, src=src, group=group)
            raise
        finally:
            _local.kernels = _local.nested = None
        message[0] = ("ok", what, registered, answer, kept, nested)
    dist.broadcast_object_list(message, src=src, group=group)
    kind, sent_for, registered, *payload = message[0]
    # ranks are numbered within the agreeing group; with set_group's, say which process its rank 0 is
    chosen = state.process.agreements.chosen_group
    within = "" if chosen is None else f", in the group given to set_group, whose rank 0 is global rank {src}"
    gaps = [] if rank == 0 else _registration_gaps(registered)
    if sent_for != what:
        raise TuningError(f"{what}: rank {rank} of {size}{within} received rank 0's decision for {sent_for} instead: "
                          + (f"the ranks register other backends for {'; '.join(gaps)}, so a rank selected such an "
                             "op alone (one backend registered there) or agreed on it alone; install the same "
                             "plug-ins on every rank and register their backends before selecting" if gaps else
                             "the ranks select their kernels in different orders; select them on every rank in the "
                             "same order, from one thread"))
    if gaps:
        _warn_gaps(rank, size, gaps)
    if kind == "error":
        name, text = payload
        error = {"KeyError": KeyError, "ValueError": ValueError}.get(name, TuningError)
        raise error(f"{text} (decided on rank 0 of {size}{within})" if error is not TuningError
                    else f"{what}: rank 0 failed with {name}: {text} (decided on rank 0 of {size}{within})")
    decision, kept, nested = payload
    log.info("%s: rank %d of %d runs rank 0's decision", what, rank, size)
    return decision, kept, nested


def _registrations() -> dict[str, tuple[str, ...]]:
    """Every registered op's backends on this rank: rank 0 sends them with each answer."""
    return {op: tuple(sorted(spec_list(registry.get(op)))) for op in registry.ops()}


def _registration_gaps(rank0: dict[str, tuple[str, ...]]) -> list[str]:
    """The ops registered with other backends here than on rank 0, each as words naming both sets. An op with fewer
    than two registered backends is selected without the ranks' agreement, so where a plug-in is installed on some
    ranks only, some ranks wait in a broadcast for it that the others never make."""
    here = _registrations()

    def named(backends: tuple[str, ...]) -> str:
        return ", ".join(backends) or "none"
    return [f"op {op!r} (rank 0: {named(rank0.get(op, ()))}; here: {named(here.get(op, ()))})"
            for op in sorted(set(rank0) | set(here)) if rank0.get(op, ()) != here.get(op, ())]


def _warn_gaps(rank: int, size: int, gaps: list[str]) -> None:
    """Warn once per set of differences: no selection has gone wrong yet, but one of those ops may."""
    warned = state.process.agreements.gaps_warned
    if tuple(gaps) in warned:
        return
    warned.add(tuple(gaps))
    log.warning("rank %d of %d registers other backends than rank 0 for %s: a selection of such an op can leave "
                "the ranks waiting in different collectives until the process group's timeout, or running "
                "different kernels; install the same plug-ins on every rank and register their backends before "
                "selecting", rank, size, "; ".join(gaps))


def op_agreement(op: str, mode: str, platform_key: str) -> tuple[str, tuple]:
    """The words naming an op's agreement in `mode` and its key: every rank must make that broadcast under the same
    ones, whether it decides (tuning.decide) or sees fewer than two usable backends (agree_on_fewer)."""
    return f"op {op!r} ({mode} mode)", (op, mode, platform_key)


def agree_on_fewer(op: str, usable: list[str], none_usable: str, *, mode: str, platform_key: str,
                   forced: str | None = None) -> None:
    """Make `op`'s agreement on a rank where fewer than two of its registered backends are usable, or where
    AUTOSEL_BACKEND forces one (usable: their names, one or none), as the ranks that see several make it in
    tuning.decide, so that none of them is left waiting in the broadcast. Rank 0 sends its one backend, untuned, as
    the table every rank runs, or its none_usable error, which every rank raises (a ValueError). Another rank raises
    where it cannot run rank 0's table: a TuningError, or with no usable backend a ValueError, none_usable naming
    both ranks. mode, platform_key: the selection's, which tuning.decide's words and key are made of.

    forced: the backend AUTOSEL_BACKEND forces here (selector._choose); usable is it, or empty where it is not
    registered for the op, and none_usable then that KeyError's text (rank 0 sends it as a KeyError). A rank forced
    to another backend than the agreed table runs raises a TuningError naming AUTOSEL_BACKEND; a rank not forced runs
    rank 0's forced backend where it can, as it runs any table of rank 0's."""
    from autosel.dispatch import BucketTable
    from autosel.platforms import capturing_cuda_graph

    def one() -> BucketTable:
        if not usable:
            raise (KeyError if forced else ValueError)(none_usable)
        return BucketTable(op, mode, usable[0], {})

    what, key = op_agreement(op, mode, platform_key)  # as tuning.decide's, whose broadcast the other ranks make
    table = agree(one, what=what, key=key, in_capture=capturing_cuda_graph())
    chosen = {table.default, *table.winners.values()}
    world = _world()
    if forced is not None and chosen != {forced} and world is not None:
        raise TuningError(f"{what}: AUTOSEL_BACKEND forces {forced!r} on rank {world[0]} of {world[1]}, but the "
                          f"ranks' table for it runs {', '.join(map(repr, sorted(chosen)))} (rank 0's decision, made "
                          "now or at the op's first selection); set AUTOSEL_BACKEND alike on every rank before "
                          "selecting, and call clear_cache() on every rank after changing it")
    if not usable and world is not None:  # rank 0 could run some (with none it raised, above): this rank none
        raise ValueError(f"{none_usable} on rank {world[0]} of {world[1]}, where rank 0 chose "
                         f"{', '.join(map(repr, sorted(chosen)))}; every rank must see the same device and packages")
    check_eligible(chosen, set(usable), what=what)


def check_eligible(chosen: set[str], eligible: set[str], *, what: str) -> None:
    """Rank 0's backends must be runnable here too; ranks with different devices or packages cannot agree."""
    missing = sorted(chosen - eligible)
    if missing:
        world = _world()
        rank = world[0] if world else 0
        raise TuningError(f"{what}: rank 0 chose {', '.join(map(repr, missing))}, which is not eligible on rank "
                          f"{rank} (eligible here: {sorted(eligible)}); every rank must see the same device and "
                          "packages, and AUTOSEL_BACKEND alike")
