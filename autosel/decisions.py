"""The value types of a tuning decision: what was measured, what was rejected and why, and who won."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

OP_LEVEL_BUCKET = "*"  # the bucket of the op-level decision, stored beside the per-bucket ones


def bucket_text(key: tuple) -> str:
    """A bucket key (a tuple of JSON scalars) as stored in the DB's bucket column: "[2048, 4096]"."""
    return json.dumps(list(key))


# A bucket key is stored as text (bucket_text) in the DB's key: a few numbers and names, never a payload (a bucket
# function returning a 5 MB string stored it in every row it tuned).
MAX_BUCKET_TEXT = 256
BUCKET_TYPES = (int, float, str, bool)


def bucket_problem(key: object) -> str | None:
    """What makes `key` no bucket key, or None: a bucket key is a tuple (exactly) of ints, finite floats, strings
    and bools (exactly those types: a subclass may hash or compare as it likes), at most MAX_BUCKET_TEXT long as
    stored text."""
    if type(key) is not tuple:
        return f"it is a {type(key).__name__}, not a tuple"
    odd = next((v for v in key if type(v) not in BUCKET_TYPES), None)
    if odd is not None:
        return f"it holds {type(odd).__name__} {short_repr(odd)}, which is not an int, float, str or bool"
    if any(type(v) is float and not math.isfinite(v) for v in key):  # NaN != NaN: one bucket stored per call
        return "it holds a float that is not finite"
    length = len(bucket_text(key))
    if length > MAX_BUCKET_TEXT:
        return f"it is {length} characters long as text, over {MAX_BUCKET_TEXT}"
    return None


def bucket_key_rule(key: object, problem: str) -> str:
    """The sentence for a bucket function that returned what is no bucket key, at tune time and at call time."""
    return (f"its bucket function returned {short_repr(key)}, which is no bucket key: {problem}; it must return a "
            f"tuple of ints, finite floats, strings or bools, at most {MAX_BUCKET_TEXT} characters as JSON (such as "
            "(tokens rounded to a power of two, hidden))")


def short_repr(value: object) -> str:
    """repr(value), cut to 60 characters: a value named in a message, whatever it is."""
    try:
        text = repr(value)
    except Exception as exc:  # a value whose repr raises is described by its type alone
        return f"(repr raised {type(exc).__name__})"
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(value: object) -> bool:
    """A numeric bucket component (a bool such as is_neox is a flag, not a number)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def key_order(key: tuple) -> tuple:
    """A sort key for bucket keys, whose components mix numbers and other values: numbers by value."""
    return tuple((0, v, "") if is_number(v) else (1, 0, str(v)) for v in key)


def bucket_order(text: str) -> tuple:
    """Sorts stored buckets: the op-level one first, then by their numbers (2048 before 16384)."""
    try:
        return (1, key_order(parse_bucket(text)))
    except ValueError:
        return (0, ())


def parse_bucket(text: str) -> tuple:
    """The inverse of bucket_text; ValueError for the op-level bucket or text that is not a JSON list."""
    value = json.loads(text)
    if not isinstance(value, list):
        raise ValueError(f"bucket {text!r} is not a JSON list")
    return tuple(value)


def versions_hash(versions: dict[str, str]) -> str:
    """A short stable hash of a version vector; part of a decision's key."""
    text = json.dumps(sorted(versions.items()), separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Measurement:
    """Timing statistics of one candidate on one shape, in microseconds."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    method: str
    mad_us: float = 0.0  # median absolute deviation: a spread that a few descheduled samples cannot inflate
    round_medians_us: tuple[float, ...] = ()  # one median per interleaved round: drift shows up here
    host_us: float | None = None  # eager CUDA calls: the host's part of a call (timing.host_and_device_us)
    device_us: float | None = None  # and the device's part

    @property
    def drift(self) -> float:
        """Half the relative range of the per-round medians: how far the median moved from round to round."""
        if len(self.round_medians_us) < 2 or self.median_us <= 0:
            return 0.0
        return (max(self.round_medians_us) - min(self.round_medians_us)) / self.median_us / 2


@dataclass(frozen=True)
class ShapeResult:
    """One candidate on one representative shape: its error against the reference and its timing."""

    shape: dict[str, Any]
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    timing: Measurement | None = None
    first_call_s: float | None = None
    plan_us: float | None = None  # planned ops: the median time to build the plan, outside the timed calls


@dataclass(frozen=True)
class CandidateResult:
    backend: str
    status: str  # "ok" (measured), "rejected" (failed a check, raised, too slow, ...)
    reason: str | None = None
    score: float | None = None  # geometric mean over shapes of time / best time on that shape
    shapes: tuple[ShapeResult, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class DecisionKey:
    platform_key: str
    op: str
    mode: str
    bucket: str
    versions_hash: str


@dataclass(frozen=True)
class Decision:
    """A winner with its evidence; stored as one row of the tuning DB."""

    op: str
    mode: str
    bucket: str
    winner: str
    platform_key: str
    versions: dict[str, str]
    candidates: tuple[CandidateResult, ...]
    margin: float  # the margin a challenger had to beat the default by
    runner_up: str | None = None
    lead_over_runner_up: float | None = None  # runner-up score / winner score - 1
    per_shape_winners: tuple[tuple[str, str], ...] = ()  # (shape as JSON, backend)
    method: str = ""
    tune_s: float = 0.0
    created_at: str = ""
    autosel_version: str = ""
    checked_with: str = ""  # OpDefinition.checked_with when it was tuned; "" in rows stored before it was kept
    # What it was measured on, part by part (autosel.staleness.fingerprint); empty in rows stored before it was kept.
    fingerprint: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> DecisionKey:
        return DecisionKey(self.platform_key, self.op, self.mode, self.bucket, versions_hash(self.versions))

    def candidate(self, backend: str) -> CandidateResult | None:
        return next((c for c in self.candidates if c.backend == backend), None)

    def untimed(self, eligible: Iterable[str]) -> list[str]:
        """The backends among `eligible` that this decision never considered (registered or installed since): a
        decision that did not time a backend eligible here is a miss, so the new backend gets timed. A row stored
        without its candidates cannot tell, and misses nothing."""
        considered = {c.backend for c in self.candidates}
        if not considered:
            return []
        return [b for b in eligible if b not in considered]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for kept_later in ("checked_with", "fingerprint"):  # rows stored before it was kept read and write as they did
            if not data[kept_later]:
                del data[kept_later]
        for candidate in data["candidates"]:  # only planned ops' rows carry plan_us, as rows did before it
            for shape in candidate["shapes"]:
                if shape.get("plan_us") is None:
                    shape.pop("plan_us", None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Decision":
        data = dict(data)
        data["candidates"] = tuple(_candidate_from_dict(c) for c in data.get("candidates", ()))
        data["per_shape_winners"] = tuple(tuple(p) for p in data.get("per_shape_winners", ()))
        data["versions"] = dict(data.get("versions", {}))
        data["fingerprint"] = dict(data.get("fingerprint") or {})
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Decision":
        return cls.from_dict(json.loads(text))


def _candidate_from_dict(data: dict[str, Any]) -> CandidateResult:
    shapes = []
    for s in data.get("shapes", ()):
        timing = s.get("timing")
        shapes.append(ShapeResult(
            shape=dict(s["shape"]),
            max_abs_err=s.get("max_abs_err"),
            max_rel_err=s.get("max_rel_err"),
            timing=Measurement(**{**timing, "round_medians_us": tuple(timing.get("round_medians_us", ()))})
            if timing else None,
            first_call_s=s.get("first_call_s"),
            plan_us=s.get("plan_us"),
        ))
    return CandidateResult(
        backend=data["backend"], status=data["status"], reason=data.get("reason"),
        score=data.get("score"), shapes=tuple(shapes),
    )





def version_diff(stored: dict[str, str], current: dict[str, str]) -> str:
    """The versions that differ between a stored decision's vector and this machine's, in words."""
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
