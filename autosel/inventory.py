"""What each stored decision means on this machine: in use, shadowed, stale, unusable, or for an unknown op."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from autosel.db import closest
from autosel.db.tools import table_key
from autosel.decisions import OP_LEVEL_BUCKET, Decision, near_detail, versions_hash
from autosel.platforms import PlatformInfo, near_rank, version_vector
from autosel.registry import KernelRegistry
from autosel.staleness import outdated, version_staleness


@dataclass(frozen=True)
class Entry:
    """One stored decision as this machine sees it: where it came from and whether selection would use it."""

    decision: Decision
    layer_path: str
    layer_kind: str  # "user" | "shipped" | "memory"
    status: str  # "in use", "shadowed", "stale", "unusable", "unknown op"
    detail: str = ""
    near: bool = False  # in use as a near match (AUTOSEL_MATCH=device or arch); detail says what differs


def unregistered(*ops: str) -> str:
    """Why stored ops are unknown here: an op a script registers exists in that script's processes only."""
    named = f"op {ops[0]!r} is" if len(ops) == 1 else f"ops {', '.join(map(repr, ops))} are"
    return (f"{named} not registered in this process: install the package whose `autosel.ops` entry point registers "
            f"{'it' if len(ops) == 1 else 'them'}, or, for an op a script registers, register it through such an entry "
            "point so that the CLI sees it")
class StoredRows:
    """Rows already read from the DB (the ones `autosel show` lists), answering TuningDB.buckets from them, so that
    autosel.staleness.outdated judges a listed row exactly as selection judges it in the DB."""

    def __init__(self, pairs: Iterable[tuple[Decision, object]]) -> None:
        self._tables: dict[tuple, list[Decision]] = {}  # (layer path, tune) -> its bucket rows
        for decision, layer in pairs:
            if decision.bucket != OP_LEVEL_BUCKET:
                self._tables.setdefault((layer.path, table_key(decision)), []).append(decision)

    def buckets(self, decision: Decision, layer, usable: Callable[[str], bool] = lambda backend: True
                ) -> list[Decision]:
        return [d for d in self._tables.get((layer.path, table_key(decision)), []) if usable(d.winner)]


class Inventory:
    """Classifies stored decisions against this machine: platform key, current version vector, eligibility."""

    def __init__(self, platform: PlatformInfo, registry: KernelRegistry, match: str = "exact") -> None:
        """match: AUTOSEL_MATCH, which near rows selection takes when no exact one is stored."""
        self.platform, self.registry, self.match = platform, registry, match
        self._ops: dict[str, tuple[list, list[str], dict[str, str]]] = {}

    def current(self, op: str) -> tuple[list, list[str], dict[str, str]]:
        """(registered specs, eligible backends, current version vector) of `op` here."""
        if op not in self._ops:
            specs = self.registry.get(op)
            eligible = [s for s in specs if s.is_available(self.platform)]
            self._ops[op] = (specs, [s.backend.value for s in eligible], version_vector(self.platform, eligible))
        return self._ops[op]

    def staleness(self, decision: Decision) -> str | None:
        """Why a row no longer matches this machine (platform key or version vector), or None."""
        _, eligible, versions = self.current(decision.op)
        return version_staleness(decision, self.platform.key, versions, eligible)

    def prunable(self, decision: Decision) -> str | None:
        """Why `prune` may delete a row: only rows of this platform whose versions changed for a known op."""
        if decision.platform_key != self.platform.key or not self.current(decision.op)[0]:
            return None  # other machines' rows and unknown ops cannot be judged from here
        return self.staleness(decision)

    def outdated(self, rows, decision: Decision, layer) -> str:
        """Why selection passes over this op-level row although its winner can run here, or "": selection's own
        rule (autosel.staleness.outdated, the `fits` of its lookups), so that show and selection never disagree.
        rows: the DB, or StoredRows of the rows listed."""
        specs, eligible, _ = self.current(decision.op)
        return outdated(rows, decision, layer, eligible, self.registry.definition(decision.op),
                        [s for s in specs if s.backend.value in eligible])

    def entries(self, pairs: Iterable[tuple[Decision, object]]) -> list[Entry]:
        """In layer order: the first current, usable op-level row of a key is "in use", later ones "shadowed"; a
        bucket row is in use where the op-level row of its layer is."""
        pairs = list(pairs)
        rows = StoredRows(pairs)
        used: dict = {}
        out = []
        for decision, layer in pairs:
            specs, eligible, _ = self.current(decision.op)
            stale = self.staleness(decision)
            if not specs:
                status, detail = "unknown op", unregistered(decision.op)
            elif stale:
                status, detail = "stale", stale
            elif not eligible:
                status, detail = "unusable", "no backend of this op can run here (`autosel doctor` says why)"
            elif decision.winner not in eligible:
                status, detail = "unusable", f"winner {decision.winner!r} is not eligible here (eligible: {eligible})"
            elif decision.bucket == OP_LEVEL_BUCKET and (reason := self.outdated(rows, decision, layer)):
                status, detail = "stale", f"{reason}: `autosel tune` times the eligible backends again"
            elif decision.bucket == OP_LEVEL_BUCKET and decision.key in used:
                status, detail = "shadowed", f"the {used[decision.key]} layer's row is used instead"
            else:  # a bucket row is settled beside the op-level row of its layer (_bucket_status), as selection does
                status, detail = "in use", ""
                if decision.bucket == OP_LEVEL_BUCKET:
                    used[decision.key] = layer.kind
            out.append(Entry(decision, layer.path, layer.kind, status, detail))
        if self.match != "exact":
            out = self._near_matches(list(zip(out, (layer for _, layer in pairs))), rows)
        op_level = {(e.layer_path, e.decision.key): e for e in out if e.decision.bucket == OP_LEVEL_BUCKET}
        return [self._bucket_status(e, op_level) for e in out]

    def _near_matches(self, listed: list[tuple[Entry, object]], rows: StoredRows) -> list[Entry]:
        """Mark the rows selection takes as near matches, as TuningDB.lookup_near picks them with the `fits` of
        tuning.lookup_stored: per op and mode without an exact op-level row in use, among the op-level rows of
        another key that AUTOSEL_MATCH accepts, whose winner is eligible and that are not `outdated`, the closest
        (same device before same arch, earlier layer, newest row); then its bucket rows of the same layer. A row
        passed over only for being outdated says why."""
        exact = {(e.decision.op, e.decision.mode) for e, _ in listed
                 if e.status == "in use" and e.decision.bucket == OP_LEVEL_BUCKET}
        layers = list(dict.fromkeys(e.layer_path for e, _ in listed))
        found: dict[tuple, list] = {}
        passed_over: dict[int, str] = {}  # position in `listed` -> why selection does not take it
        for position, (e, layer) in enumerate(listed):
            d = e.decision
            _, eligible, versions = self.current(d.op)
            rank = near_rank(d.platform_key, self.platform.key, self.match)
            if (d.bucket != OP_LEVEL_BUCKET or (d.op, d.mode) in exact or rank is None or not eligible
                    or (d.platform_key, d.key.versions_hash) == (self.platform.key, versions_hash(versions))
                    or d.winner not in eligible):
                continue  # not a near row lookup_near would consider (the exact key is lookup's, judged above)
            if reason := self.outdated(rows, d, layer):
                passed_over[position] = reason
                continue
            found.setdefault((d.op, d.mode), []).append(
                (rank, layers.index(e.layer_path), d.created_at, (d.platform_key, d.key.versions_hash, e.layer_path)))
        chosen = {op_mode: closest(items) for op_mode, items in found.items()}
        out = []
        for position, (e, _) in enumerate(listed):
            d = e.decision
            _, eligible, versions = self.current(d.op)
            if e.status == "stale" and chosen.get((d.op, d.mode)) == (d.platform_key, d.key.versions_hash, e.layer_path):
                if d.winner in eligible:
                    e = replace(e, status="in use", near=True, detail=near_detail(d, self.platform.key, versions))
                else:
                    e = replace(e, status="unusable", detail=f"winner {d.winner!r} is not eligible here (eligible: "
                                                             f"{eligible})")
            elif position in passed_over:
                e = replace(e, detail=f"{e.detail}; not taken as a near match (AUTOSEL_MATCH={self.match}): it "
                                      f"{passed_over[position]}")
            out.append(e)
        return out

    @staticmethod
    def _bucket_status(entry: Entry, op_level: dict[tuple, Entry]) -> Entry:
        """A bucket row is used only beside the op-level row of its tune (same key but the bucket, same layer)
        that selection uses: get_kernel reads the bucket rows of the layer its op-level decision came from.
        op_level: the op-level entries by (layer path, key)."""
        d = entry.decision
        if d.bucket == OP_LEVEL_BUCKET or entry.status != "in use":
            return entry
        parent = op_level.get((entry.layer_path, replace(d.key, bucket=OP_LEVEL_BUCKET)))
        if parent is not None and parent.status == "in use":
            return entry
        why = (f"its op-level row in this layer is {parent.status}" if parent else "this layer has no op-level row "
               "for its tune") + "; get_kernel reads bucket rows beside the op-level decision it uses"
        return replace(entry, status="shadowed", detail=why)
