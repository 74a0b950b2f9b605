"""What each stored decision means on this machine: in use, shadowed, stale, unusable, or for an unknown op."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from autosel.db_tools import table_key
from autosel.decisions import OP_LEVEL_BUCKET, Decision, versions_hash
from autosel.platforms import PlatformInfo, near_rank, version_vector
from autosel.registry import KernelRegistry


@dataclass(frozen=True)
class Entry:
    """One stored decision as this machine sees it: where it came from and whether selection would use it."""

    decision: Decision
    layer_path: str
    layer_kind: str  # "user" | "shipped" | "memory"
    status: str  # "in use", "shadowed", "stale", "unusable", "unknown op"
    detail: str = ""
    near: bool = False  # in use as a near match (AUTOSEL_MATCH=device or arch); detail says what differs


def version_diff(stored: dict[str, str], current: dict[str, str]) -> str:
    changed = [f"{k} {stored.get(k, '(none)')} -> {current.get(k, '(none)')}"
               for k in sorted(set(stored) | set(current)) if stored.get(k) != current.get(k)]
    return ", ".join(changed) or "same versions, different eligible backends"


def near_detail(decision: Decision, platform_key: str, versions: dict[str, str]) -> str:
    """What differs between a decision taken as a near match (AUTOSEL_MATCH) and this machine."""
    parts = []
    if decision.platform_key != platform_key:
        parts.append(f"tuned on {decision.platform_key}, this machine is {platform_key}")
    if decision.key.versions_hash != versions_hash(versions):
        parts.append(f"versions differ: {version_diff(decision.versions, versions)}")
    return "near match: " + ("; ".join(parts) or "same key")


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
        if decision.platform_key != self.platform.key:
            return f"tuned on {decision.platform_key}, this machine is {self.platform.key}"
        specs, eligible, versions = self.current(decision.op)
        if not eligible:  # no backend runs here (torch not installed, say): no vector to judge the row by
            return None
        if decision.key.versions_hash != versions_hash(versions):
            return f"versions differ: {version_diff(decision.versions, versions)}"
        return None

    def prunable(self, decision: Decision) -> str | None:
        """Why `prune` may delete a row: only rows of this platform whose versions changed for a known op."""
        if decision.platform_key != self.platform.key or not self.current(decision.op)[0]:
            return None  # other machines' rows and unknown ops cannot be judged from here
        return self.staleness(decision)

    def entries(self, pairs: Iterable[tuple[Decision, object]]) -> list[Entry]:
        """In layer order: the first current, usable op-level row of a key is "in use", later ones "shadowed"; a
        bucket row is in use where the op-level row of its layer is."""
        pairs = list(pairs)
        used: dict = {}
        out = []
        bucket_winners: dict[tuple, set[str]] = {}  # (layer path, tune) -> the winners of its bucket rows
        for decision, layer in pairs:
            if decision.bucket != OP_LEVEL_BUCKET:
                bucket_winners.setdefault((layer.path, table_key(decision)), set()).add(decision.winner)
        for decision, layer in pairs:
            specs, eligible, _ = self.current(decision.op)
            stale = self.staleness(decision)
            if not specs:
                status, detail = "unknown op", f"op {decision.op!r} is not registered here (is its plug-in installed?)"
            elif stale:
                status, detail = "stale", stale
            elif not eligible:
                status, detail = "unusable", "no backend of this op can run here (`autosel doctor` says why)"
            elif decision.winner not in eligible:
                status, detail = "unusable", f"winner {decision.winner!r} is not eligible here (eligible: {eligible})"
            elif decision.bucket == OP_LEVEL_BUCKET and (untimed := decision.untimed(eligible)):
                status, detail = "stale", (f"never timed {', '.join(untimed)}, eligible here (registered or "
                                           "installed since): `autosel tune` times it")
            elif decision.bucket == OP_LEVEL_BUCKET and (gone := sorted(
                    bucket_winners.get((layer.path, table_key(decision)), set()) - set(eligible))):
                status, detail = "stale", (f"its bucket rows run {', '.join(gone)}, not eligible here (unregistered or "
                                           "uninstalled since): `autosel tune` times the eligible backends again")
            elif decision.bucket == OP_LEVEL_BUCKET and decision.checked_with and (
                    definition := self.registry.definition(decision.op)) and decision.checked_with != (
                    now := definition.checked_with):
                status, detail = "stale", (f"checked with {decision.checked_with}; the op is checked with {now} now: "
                                           "`autosel tune` times it again")
            elif decision.bucket == OP_LEVEL_BUCKET and decision.key in used:
                status, detail = "shadowed", f"the {used[decision.key]} layer's row is used instead"
            else:  # a bucket row is settled beside the op-level row of its layer (_bucket_status), as selection does
                status, detail = "in use", ""
                if decision.bucket == OP_LEVEL_BUCKET:
                    used[decision.key] = layer.kind
            out.append(Entry(decision, layer.path, layer.kind, status, detail))
        out = self._near_matches(out) if self.match != "exact" else out
        op_level = {(e.layer_path, e.decision.key): e for e in out if e.decision.bucket == OP_LEVEL_BUCKET}
        return [self._bucket_status(e, op_level) for e in out]

    def _near_matches(self, entries: list[Entry]) -> list[Entry]:
        """Mark the rows selection takes as near matches, as TuningDB.lookup_near picks them: per op and mode
        without an exact op-level row in use, the closest stale tune (same device before same arch, earlier
        layer, newest row), its op-level row and its bucket rows of the same layer."""
        exact = {(e.decision.op, e.decision.mode) for e in entries
                 if e.status == "in use" and e.decision.bucket == OP_LEVEL_BUCKET}
        layers = list(dict.fromkeys(e.layer_path for e in entries))
        candidates = []
        for e in entries:
            d = e.decision
            rank = near_rank(d.platform_key, self.platform.key, self.match)
            if (e.status == "stale" and d.bucket == OP_LEVEL_BUCKET and rank is not None
                    and (d.op, d.mode) not in exact and d.winner in self.current(d.op)[1]
                    and not d.untimed(self.current(d.op)[1])):
                candidates.append((rank, layers.index(e.layer_path), e))
        candidates.sort(key=lambda item: item[2].decision.created_at, reverse=True)
        chosen: dict[tuple, tuple] = {}
        for rank, index, e in sorted(candidates, key=lambda item: item[:2]):  # stable: newest first within a rank
            d = e.decision
            chosen.setdefault((d.op, d.mode), (d.platform_key, d.key.versions_hash, e.layer_path))
        out = []
        for e in entries:
            d = e.decision
            if e.status == "stale" and chosen.get((d.op, d.mode)) == (d.platform_key, d.key.versions_hash, e.layer_path):
                if d.winner in self.current(d.op)[1]:
                    e = replace(e, status="in use", near=True,
                                detail=near_detail(d, self.platform.key, self.current(d.op)[2]))
                else:
                    e = replace(e, status="unusable",
                                detail=f"winner {d.winner!r} is not eligible here (eligible: {self.current(d.op)[1]})")
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
