"""What a DB covers for a target platform: whether each op an engine needs has a usable decision per mode (and
per bucket), so an image build can refuse to ship an empty or mismatched DB (`autosel check`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from autosel.decisions import OP_LEVEL_BUCKET, Decision, near_detail, version_diff, versions_hash
from autosel.db import closest
from autosel.platforms import PlatformInfo, installed_version, key_fields, modes_for_device, near_rank
from autosel.staleness import outdated

# Versions that only the target machine can tell (its driver, the runtime torch finds there): not compared
# when checking a DB for another platform than this machine.
TARGET_ONLY_VERSIONS = ("cuda", "hip", "driver_major")


@dataclass(frozen=True)
class Coverage:
    """One required (op, mode) on the target platform: whether selection there finds a usable decision."""

    op: str
    mode: str
    ok: bool
    detail: str  # what was found, or why nothing usable was
    winner: str | None = None
    layer: str | None = None  # "shipped /path/x.db"
    near: str | None = None  # a near match (AUTOSEL_MATCH): what differs
    buckets: int = 0  # bucket rows beside the op-level decision


def modes_of(platform_key: str) -> list[str]:
    """The modes selection on a platform uses: a GPU replays graphs too (as `autosel tune` tunes there)."""
    return list(modes_for_device(key_fields(platform_key)[0]))


def check(ops: Sequence[str], *, db, registry, platform: PlatformInfo, target: str | None = None,
          modes: Sequence[str] | None = None, match: str = "exact", buckets: bool = False) -> list[Coverage]:
    """Per op and mode, what selection on `target` (default: this machine, `platform`) finds in `db`.

    On this machine that is exactly selection's lookup (platform key, version vector, eligible winner, then near
    rows that `match` accepts). For another platform key (an image built on a machine without its GPU), the rows
    stored for that key whose versions agree with the packages installed here, except the versions only the
    target can tell (TARGET_ONLY_VERSIONS); a winner must be a registered backend of the op.
    buckets: an op that declares a bucket function also needs the bucket rows of its decision, all usable."""
    target = target or platform.key
    out = []
    for op in ops:
        specs = registry.get(op)
        definition = registry.definition(op)
        for mode in modes or modes_of(target):
            if not specs:
                out.append(Coverage(op, mode, False, f"op {op!r} is not registered here (is the package that "
                                                     "declares it installed?)"))
            elif target == platform.key:
                out.append(_here(op, mode, specs, definition, db, platform, match, buckets))
            else:
                out.append(_there(op, mode, specs, definition, db, target, match, buckets))
    return out


def _with_buckets(found: Coverage, decision: Decision, layer, db, usable, definition, buckets: bool) -> Coverage:
    rows = db.buckets(decision, layer)
    bad = [row for row in rows if not usable(row.winner)]
    found = replace(found, buckets=len(rows))
    # Rows keyed otherwise than the bucket function keys their shapes today never get here: selection passes their
    # decision over (autosel.staleness.outdated), and so does check, with or without --buckets.
    if buckets and definition is not None and definition.bucket is not None:
        if not rows:
            return replace(found, ok=False, detail=found.detail + "; but no bucket rows beside it (tuned before "
                           "buckets, or with a bucket function that failed): re-tune it")
        if bad:
            names = ", ".join(f"{row.bucket} ({row.winner})" for row in bad)
            return replace(found, ok=False, detail=found.detail + f"; but bucket rows name backends not usable there: "
                           f"{names}")
    return found


def _here(op, mode, specs, definition, db, platform, match, buckets) -> Coverage:
    from autosel.platforms import version_vector
    from autosel.tuning import decision_key, lookup_stored

    eligible = [s for s in specs if s.is_available(platform)]
    if len(specs) == 1 or len(eligible) == 1:
        only = (specs if len(specs) == 1 else eligible)[0].backend.value
        return Coverage(op, mode, True, f"no decision needed: {only} is the only usable backend here", winner=only)
    if not eligible:
        return Coverage(op, mode, False, "no backend is eligible here; only explicit backend=... calls work")
    names = [s.backend.value for s in eligible]
    usable = set(names).__contains__
    versions = version_vector(platform, eligible)
    key = decision_key(op, eligible, platform, mode, versions)
    hit = lookup_stored(db, key, eligible, match=match, versions=versions, say=False)  # selection's own lookup
    if hit is None and (older := db.lookup(key, usable=usable)) is not None:
        reason = outdated(db, older[0], older[1], names, definition, eligible)
        return Coverage(op, mode, False, f"the stored {mode} decision ({older[0].winner}, {older[1].kind} DB "
                        f"{older[1].path}) {reason}: re-tune the op (selection keeps it only where nothing can be "
                        "timed: AUTOSEL_TUNE=off, CUDA-graph capture)")
    if hit is None:
        stored = [d for d, _ in db.decisions(op) if d.mode == mode and d.bucket == OP_LEVEL_BUCKET]
        why = _closest_miss(stored, platform.key, versions)
        return Coverage(op, mode, False, f"no usable {mode} decision for {platform.key}{why}")
    decision, _, layer = hit
    near = near_detail(decision, platform.key, versions) if decision.key != key else None
    found = Coverage(op, mode, True, f"{decision.winner} ({layer.kind} DB {layer.path})", winner=decision.winner,
                     layer=f"{layer.kind} {layer.path}", near=near)
    return _with_buckets(found, decision, layer, db, usable, definition, buckets)


def _closest_miss(stored: list[Decision], platform_key: str, versions: dict[str, str]) -> str:
    same = [d for d in stored if d.platform_key == platform_key]
    if same:
        return f" with these versions (stored ones differ: {version_diff(same[0].versions, versions)})"
    return f" (stored for: {', '.join(sorted({d.platform_key for d in stored}))})" if stored else " (none stored)"


def _there(op, mode, specs, definition, db, target, match, buckets) -> Coverage:
    names = [s.backend.value for s in specs]
    registered = set(names).__contains__
    rows = [(d, layer) for d, layer in db.decisions(op)
            if d.op == op and d.mode == mode and d.bucket == OP_LEVEL_BUCKET]
    layers = list(dict.fromkeys(layer.path for _, layer in rows))
    found, passed_over = [], []
    for decision, layer in rows:
        differ = _differ_here(decision.versions)
        exact = decision.platform_key == target and not differ
        rank = -1 if exact else near_rank(decision.platform_key, target, match)  # exact rows first, as lookup
        if rank is None or not registered(decision.winner):
            continue
        # Selection's own rule (staleness.outdated), as far as it can be told from here: which backends are eligible
        # on the target is not known here, so the row is judged as one that cannot tell what it timed
        # (Decision.untimed), against the backends registered here; other tolerances still count.
        if reason := outdated(db, replace(decision, candidates=()), layer, names, definition, specs):
            passed_over.append((decision, layer, reason))
            continue
        found.append((rank, layers.index(layer.path), decision.created_at, (decision, layer, differ)))
    best = closest(found)  # the row TuningDB.lookup / lookup_near would take on the target
    if best is None and passed_over:
        decision, layer, reason = passed_over[0]
        return Coverage(op, mode, False, f"the stored {mode} decision for {target} ({decision.winner}, {layer.kind} "
                        f"DB {layer.path}) {reason}: re-tune the op on the target")
    if best is None:
        same = [d for d, _ in rows if d.platform_key == target]
        known = [d for d in same if registered(d.winner)]
        why = (f" with the versions installed here ({_differ_here(known[0].versions)})" if known else
               f" (its stored winners {', '.join(sorted({d.winner for d in same}))} are not registered for {op} "
               "here)" if same else
               f" (stored for: {', '.join(sorted({d.platform_key for d, _ in rows}))})" if rows else " (none stored)")
        return Coverage(op, mode, False, f"no usable {mode} decision for {target}{why}")
    decision, layer, differ = best
    unchecked = sorted(k for k in decision.versions if k in TARGET_ONLY_VERSIONS)
    detail = f"{decision.winner} ({layer.kind} DB {layer.path})" + (
        f"; {', '.join(unchecked)} not checked (only the target can tell)" if unchecked else "")
    parts = ([f"tuned on {decision.platform_key}, the target is {target}"] if decision.platform_key != target else [])
    parts += [f"versions differ: {differ}"] if differ else []
    found = Coverage(op, mode, True, detail, winner=decision.winner, layer=f"{layer.kind} {layer.path}",
                     near="near match: " + "; ".join(parts) if parts else None)
    return _with_buckets(found, decision, layer, db, registered, definition, buckets)


def _differ_here(stored: dict[str, str]) -> str:
    """The stored versions that the packages installed here contradict ("" when none)."""
    current = {k: installed_version(k) or "(none)" for k in stored if k not in TARGET_ONLY_VERSIONS}
    mine = {k: v for k, v in stored.items() if k not in TARGET_ONLY_VERSIONS}
    return "" if versions_hash(mine) == versions_hash(current) else version_diff(mine, current)

