"""AUTOSEL_CHECK_RANKS: on every rank but 0, what its own DB layers would have run, against rank 0's table, warned
about once per difference, so an operator sees how far the ranks' own tunes disagree (docs/RANKS.md). Every rank
still runs rank 0's table (autosel.distributed)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from autosel import distributed, state
from autosel.decisions import key_order
from autosel.dispatch import BucketTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankDifference:
    """One place where a rank's own stored decision and rank 0's table run different backends: the op-level
    winner (bucket None) or one bucket's. here: this rank's backend, None when its DB stores no decision."""

    bucket: tuple | None
    here: str | None
    rank0: str

    def __str__(self) -> str:
        where = "op level" if self.bucket is None else f"bucket {list(self.bucket)}"
        here = "nothing stored here" if self.here is None else f"{self.here} here"
        return f"{where}: {here}, {self.rank0} on rank 0"


def differences(local: BucketTable | None, agreed: BucketTable) -> list[RankDifference]:
    """Where `local` (a rank's own stored table; None: it stores none) runs another backend than `agreed` (rank 0's):
    the op-level winner, then every bucket either table tuned, in order, each routed as a dispatcher routes it
    (BucketTable.route), so a bucket tuned on one side only differs only if the other side would run another."""
    if local is None:
        return [RankDifference(None, None, agreed.default)]
    found = [RankDifference(None, local.default, agreed.default)] if local.default != agreed.default else []
    for key in sorted({*local.winners, *agreed.winners}, key=key_order):
        here, rank0 = local.route(key), agreed.route(key)
        if here != rank0:
            found.append(RankDifference(key, here, rank0))
    return found


def check_against_local(agreed: BucketTable, local: Callable[[], BucketTable | None], *, what: str,
                        in_capture: bool = False) -> list[RankDifference]:
    """AUTOSEL_CHECK_RANKS: on a rank other than 0, the differences between `local()` (what this rank's own DB
    layers hold, looked up and never tuned) and rank 0's table, warned about once per process for each distinct
    answer. Rank 0's own answer is the table, and a single process has nobody to differ from: both return []."""
    world = None if in_capture else distributed.rank_and_size()
    if world is None or world[0] == 0:
        return []
    rank, size = world
    try:
        own = local()
    except Exception as exc:  # a diagnostic must not raise on one rank only: the ranks' next collective would hang
        log.warning("%s: AUTOSEL_CHECK_RANKS: rank %d of %d could not look up its own decision (%s: %s); it runs "
                    "rank 0's", what, rank, size, type(exc).__name__, exc)
        return []
    found = differences(own, agreed)
    said = (agreed.op, agreed.mode, tuple(found))
    reported = state.process.agreements.reported  # (op, mode, differences) this process has warned about
    if found and said not in reported:
        reported.add(said)
        log.warning("%s: rank %d of %d runs rank 0's decision, and on its own would differ: %s. "
                    "[AUTOSEL_CHECK_RANKS: every rank still runs rank 0's table; only inside CUDA-graph capture, "
                    "where nothing is broadcast, does a rank run its own. To make the ranks' DBs agree, tune once "
                    "and give every rank that DB (autosel export, AUTOSEL_DB_PATH)]",
                    what, rank, size, "; ".join(map(str, found)))
    return found
