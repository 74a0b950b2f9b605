"""The tuning loop: check every candidate against the reference, time the correct ones in interleaved rounds, choose with a noise margin."""

from __future__ import annotations

import datetime
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from autosel import checks
from autosel.decisions import (OP_LEVEL_BUCKET, CandidateResult, Decision, Measurement, ShapeResult)
from autosel.errors import TuningError
from autosel.spec import KernelSpec, OpDefinition
from autosel.timing import Timer, measure_together, summarize, synchronize

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Rule:
    """What beating a candidate takes, per timing method (docs/TUNING.md section 4)."""

    floor: float  # the least margin, however quiet the measurements
    may_lose: int = 0  # readings a win may lose, when there are three or more


# The floors: how far two fresh tunes' ratios of the same two candidates moved apart on the H200 and on this
# project's CPU machine. Graph replay repeats to a few percent; 6%, not 5%, because autosel's Triton kernels
# under 2 us replay about 0.09 us (4-8% per round) behind the vendors' and that ratio sat on a 5% floor
# (docs/TUNING.md section 7). Eager calls of small shapes are host time, which moves with the host's load.
# A CPU round is often disturbed wholesale for one candidate (descheduled, OpenMP wake-ups), so there a win
# may lose one round of three.
GRAPH_RULE = Rule(0.06)
RULES = {"cuda:graph-replay": GRAPH_RULE, "cuda:back-to-back": Rule(0.10),
         "cpu:torch.utils.benchmark": Rule(0.05, may_lose=1),
         "cuda:do_bench_cudagraph": GRAPH_RULE}  # graph replay as stored before its blocks took turns
DEFAULT_RULE = Rule(0.03)  # any other timer (tests' fake timers)
# How much slower or faster the host may run than while it was measured. The H200 machine's host ran in two
# states, the slow one about 1.6x slower (launch-bound calls moved up to 1.9x between processes a minute
# apart, tools/host_probe.py, and between two tunes: docs/TUNING.md section 4). Slower: 1.6x, from the fast
# state to the slow one. Faster: 1.25x only (1.33x and 1.43x replayed alike); a host 1.6x faster than a tune
# in the fast state had never been seen, yet that reading kept a pick 1.5x slower at every speed measured
# (rope, 6 of 13 runs flipped on it).
HOST_SLOWER, HOST_FASTER = 1.6, 1.25
HOST_SPEEDS = (1 / HOST_FASTER, HOST_SLOWER)  # the host-speed readings, as factors on the host's time
# After the first round, a candidate this many times slower than the best (geometric mean) is dropped.
DROP_FACTOR = 3.0
ROUNDS = 3


@dataclass(frozen=True)
class TuneEvent:
    """What the tuner is doing, for progress bars and logs. kind: started, rejected (at load, check or while
    timed), timing (the checks are done, the timed rounds begin), progress (one candidate measured at one
    shape), dropped, chosen."""

    kind: str
    op: str
    backend: str | None = None
    detail: str = ""
    fraction: float = 0.0  # of the op's work done so far, 0..1
    mode: str = ""  # the execution mode being tuned


@dataclass
class _Candidate:
    spec: KernelSpec
    fn: Callable[..., Any] | None = None
    reason: str | None = None
    status: str = "ok"
    errors: dict[int, tuple[float | None, float | None]] = field(default_factory=dict)
    first_call_s: dict[int, float] = field(default_factory=dict)
    samples: dict[int, list[float]] = field(default_factory=dict)
    rounds: dict[int, list[list[float]]] = field(default_factory=dict)  # shape index -> samples of each round
    splits: dict[int, list[tuple[float, float]]] = field(default_factory=dict)  # shape index -> (host, device) us

    @property
    def backend(self) -> str:
        return self.spec.backend.value

    def reject(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason


def shape_text(shape: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def relative_scores(medians: dict[str, list[float]]) -> dict[str, float]:
    """Per candidate, the geometric mean over shapes of its time relative to the best candidate on that shape."""
    n_shapes = len(next(iter(medians.values())))
    best = [min(m[i] for m in medians.values()) for i in range(n_shapes)]
    return {b: geomean([m[i] / best[i] for i in range(n_shapes)]) for b, m in medians.items()}


def _scores(candidates: list[_Candidate], n_shapes: int) -> dict[str, float]:
    return relative_scores({c.backend: [statistics.median(c.samples[i]) for i in range(n_shapes)]
                            for c in candidates})


def rule_for(method: str) -> Rule:
    return RULES.get(method, DEFAULT_RULE)


def choose(order: Sequence[str], readings: dict[str, Sequence[float]], margin: float, may_lose: int = 0) -> str:
    """The first candidate in registration order that the fastest does not beat by more than `margin` in
    every reading (each round, each host speed), or in all but `may_lose` of three or more: the default
    keeps the decision unless beaten, and among candidates level with the fastest the earliest registered
    wins, so a near-tie cannot change hands between two tunes. The fastest: the lowest median reading."""
    fastest = min(order, key=lambda b: statistics.median(readings[b]))

    def beaten(candidate: str) -> bool:
        wins = [t > f * (1.0 + margin) for t, f in zip(readings[candidate], readings[fastest], strict=True)]
        return sum(wins) >= (len(wins) - may_lose if len(wins) >= 3 else len(wins))

    return next(b for b in order if not beaten(b))


def at_host_speed(m: Measurement, factor: float) -> float:
    """m's time had the host run `factor` times slower: an eager call costs the larger of its host and
    device parts, so only a launch-bound call moves with the host. m unchanged without those parts."""
    if not m.host_us or not m.device_us:
        return m.median_us
    return m.median_us * max(factor * m.host_us, m.device_us) / max(m.host_us, m.device_us)


def readings_of(m: Measurement, rounds: int, host_speeds: Sequence[float]) -> list[float]:
    """The times a challenger must win in: the median of each of the first `rounds` rounds (the overall
    median if none), then the median at each host speed."""
    by_round = list(m.round_medians_us[:rounds]) or [m.median_us]
    return by_round + [at_host_speed(m, f) for f in host_speeds]


def relative_standard_error(m: Measurement) -> float:
    """Of a median: 1.253 sigma / sqrt(n), with sigma estimated robustly as 1.4826 x the median absolute
    deviation, so the heavy tail of a shared machine (a few descheduled samples) does not swamp it."""
    if m.median_us <= 0:
        return 0.0
    return 1.253 * 1.4826 * m.mad_us / m.median_us / math.sqrt(max(1, m.samples))


def noise(m: Measurement) -> float:
    """How far this median can be trusted: twice its standard error.

    The drift between rounds (m.drift) is stored as evidence but kept out of the margin: estimated from
    three round medians it is itself so noisy that it moved the threshold more than it steadied decisions
    (tools/stability_bench.py on a 2-core CPU: 24 of 28 decisions identical with it; 26, 25 and 27 of 28
    in three runs without it).
    """
    return 2 * relative_standard_error(m)


def _margin(measurements: Sequence[Measurement], floor: float) -> float:
    """The typical (median) noise of the measurements compared, never below the floor.

    The median over measurements, not the worst, so one disturbed shape does not freeze every decision.
    """
    return max(floor, statistics.median(noise(m) for m in measurements))


@dataclass(frozen=True)
class Verdict:
    scores: dict[str, float]  # relative_scores of the per-shape medians
    winner: str  # the op-level winner
    margin: float  # the op-level margin
    shape_winners: list[str]  # the winner of each shape, with that shape's own margin


def judge(stats: dict[str, list[Measurement]], margin_floor: float | None = None) -> Verdict:
    """The decision rule, from each candidate's per-shape measurements (dict in registration order).

    To beat a candidate, the fastest must win every reading (but those the timing method's Rule lets it
    lose): each interleaved round (rounds compared pairwise, measured close in time) and, where a call's
    host and device parts were measured, the host at each of HOST_SPEEDS (faster and slower). margin_floor
    replaces the method's floor. Also replays stored decisions (tools/stability_bench.py --compare --replay).
    """
    order = list(stats)
    everything = [m for ms in stats.values() for m in ms]
    rule = rule_for(everything[0].method)
    floor = rule.floor if margin_floor is None else margin_floor
    rounds = min(len(m.round_medians_us) for m in everything)
    speeds = HOST_SPEEDS if all(m.host_us and m.device_us for m in everything) else ()
    per_shape = {b: [readings_of(m, rounds, speeds) for m in ms] for b, ms in stats.items()}
    n_readings = len(per_shape[order[0]][0])
    # Op level: each reading's relative score over shapes (geometric mean against the best per shape).
    op_readings = {b: [] for b in order}
    for k in range(n_readings):
        for b, score in relative_scores({b: [r[k] for r in rs] for b, rs in per_shape.items()}).items():
            op_readings[b].append(score)
    scores = relative_scores({b: [m.median_us for m in ms] for b, ms in stats.items()})
    margin = _margin(everything, floor)
    shape_winners = [choose(order, {b: per_shape[b][i] for b in order},
                            _margin([stats[b][i] for b in order], floor), rule.may_lose)
                     for i in range(len(stats[order[0]]))]
    return Verdict(scores, choose(order, op_readings, margin, rule.may_lose), margin, shape_winners)


@dataclass
class CheckReport:
    errors: dict[int, tuple[float | None, float | None]]  # shape index -> (max abs, max rel) error
    first_call_s: dict[int, float]  # includes compilation on the first shape
    reason: str | None = None  # why it failed, or None


def check_candidate(fn: Callable[..., Any], definition: OpDefinition, reference: Callable[..., Any],
                    shapes: Sequence[dict], *, device: str, seed: int = 0) -> CheckReport:
    """Run `fn` and the reference on the same fresh random inputs of every shape; stop at the first failure."""
    import torch

    report = CheckReport({}, {})
    for index, shape in enumerate(shapes):
        torch.manual_seed(seed + index)
        args = definition.make_inputs(dict(shape), device)
        ref_args, call_args = checks.clone_args(args), checks.clone_args(args)
        expected = checks.outputs_of(reference(*ref_args), ref_args)
        began = time.perf_counter()
        try:
            result = fn(*call_args)
            synchronize(device)
        except (Exception, SystemExit) as exc:  # sys.exit in a kernel must not end the caller
            report.reason = f"raised {type(exc).__name__}: {exc} at {shape_text(shape)}"
            return report
        report.first_call_s[index] = time.perf_counter() - began
        outcome = checks.compare(checks.outputs_of(result, call_args), expected, rtol=definition.rtol,
                                 atol=definition.atol)
        report.errors[index] = (outcome.max_abs_err, outcome.max_rel_err)
        if not outcome.ok:
            report.reason = f"{outcome.reason} at {shape_text(shape)}"
            return report
    return report


class Tuner:
    """Tunes one op on one device in one execution mode. The timer is injected (tests pass a fake)."""

    def __init__(self, *, timer: Timer, device: str, rounds: int = ROUNDS, margin_floor: float | None = None,
                 drop_factor: float = DROP_FACTOR, budget_s: float = 30.0, seed: int = 0,
                 on_event: Callable[[TuneEvent], None] | None = None, isolate_timeout_s: float | None = None) -> None:
        """margin_floor: None for the timing method's (rule_for).
        isolate_timeout_s: check each candidate first in a child process that is killed after this long."""
        self.timer, self.device, self.rounds = timer, device, rounds
        self.isolate_timeout_s = isolate_timeout_s
        self._mode = ""  # of the tune in progress, for events
        self.margin_floor, self.drop_factor, self.budget_s, self.seed = margin_floor, drop_factor, budget_s, seed
        self.on_event = on_event or (lambda event: None)

    def tune(self, definition: OpDefinition, specs: Sequence[KernelSpec], *, reference: Callable[..., Any],
             shapes: Sequence[dict], mode: str, platform_key: str, versions: dict[str, str],
             bucket: str = OP_LEVEL_BUCKET, autosel_version: str = "") -> Decision:
        op, started, self._mode = definition.op, time.perf_counter(), mode
        if not shapes:
            raise TuningError(f"op {op!r} has no representative shapes to tune on; pass shapes= to register_op")
        self._emit("started", op, detail=f"{len(specs)} candidates, {len(shapes)} shapes, {mode} mode")
        candidates = [self._load(_Candidate(spec)) for spec in specs]
        for candidate in candidates:
            if candidate.fn is None:
                self._emit("rejected", op, candidate.backend, candidate.reason or "")
        if self.isolate_timeout_s is not None:
            self._probe_isolated(definition, candidates, reference, shapes)
        self._check(definition, candidates, reference, shapes)
        # The budget bounds the timing rounds; the checks before them (which absorb compilation) are bounded
        # by one call per candidate and shape, and reported per shape as first_call_s.
        self._time(definition, [c for c in candidates if c.status == "ok"], shapes, time.perf_counter())
        return self._decide(definition, candidates, shapes, mode=mode, platform_key=platform_key,
                            versions=versions, bucket=bucket, tune_s=time.perf_counter() - started,
                            autosel_version=autosel_version)

    def _emit(self, kind: str, op: str, backend: str | None = None, detail: str = "", fraction: float = 0.0):
        log.debug("tune %s %s %s %s", op, kind, backend or "", detail)
        self.on_event(TuneEvent(kind, op, backend, detail, fraction, self._mode))

    def _load(self, candidate: _Candidate) -> _Candidate:
        try:
            candidate.fn = candidate.spec.load()
        except (Exception, SystemExit) as exc:  # a candidate that cannot load is data, not a failure of the tune
            candidate.reject("rejected", f"could not load {candidate.spec.target!r}: {type(exc).__name__}: {exc}")
        return candidate

    def _probe_isolated(self, definition: OpDefinition, candidates: list[_Candidate], reference, shapes) -> None:
        from autosel.isolate import probe

        for candidate in candidates:
            if candidate.status != "ok":
                continue
            reason = probe(candidate.spec, definition, reference, shapes, device=self.device, seed=self.seed,
                           timeout_s=self.isolate_timeout_s)
            if reason:
                candidate.reject("rejected", f"in isolation: {reason}")
                self._emit("rejected", definition.op, candidate.backend, candidate.reason)

    def _check(self, definition: OpDefinition, candidates: list[_Candidate], reference, shapes) -> None:
        """Every candidate must match the reference on fresh random inputs of every shape before it is timed."""
        for candidate in candidates:
            if candidate.status != "ok":
                continue
            report = check_candidate(candidate.fn, definition, reference, shapes, device=self.device, seed=self.seed)
            candidate.errors, candidate.first_call_s = report.errors, report.first_call_s
            if report.reason:
                candidate.reject("rejected", report.reason)
                self._emit("rejected", definition.op, candidate.backend, candidate.reason)

    def _time(self, definition: OpDefinition, alive: list[_Candidate], shapes, timing_began: float) -> None:
        """Interleaved rounds: in each, every shape's candidates are timed together, block by block in turn
        (timing.measure_together), and the order rotates each round so no one always goes first.

        One shape's inputs exist at a time (rebuilt from the same seed each round), each candidate on its own
        copies: one, or as many as the timer's rotate_bytes asks for.
        """
        if not alive:
            return
        import torch

        op, total, done = definition.op, self.rounds * len(shapes) * len(alive), 0
        self._emit("timing", op, detail=f"{len(alive)} candidates, up to {self.rounds} rounds")
        rotate_bytes = getattr(self.timer, "rotate_bytes", 0)
        split = getattr(self.timer, "host_and_device_us", None)
        for round_index in range(self.rounds):
            shift = round_index % len(alive)
            order = alive[shift:] + alive[:shift]
            for index, shape in enumerate(shapes):
                torch.manual_seed(self.seed + 1000 + index)
                base = definition.make_inputs(dict(shape), self.device)
                calls = {c.backend: checks.rotating_call(c.fn, base, rotate_bytes) for c in order
                         if c.status == "ok"}
                times, failed = measure_together(self.timer, calls, shape=shape)
                for candidate in order:
                    if candidate.status != "ok":
                        continue
                    error = failed.get(candidate.backend)
                    if error is None and split is not None:
                        try:
                            candidate.splits.setdefault(index, []).append(split(calls[candidate.backend]))
                        except (Exception, SystemExit) as exc:
                            error = exc
                    if error is not None:
                        candidate.reject("rejected", f"raised {type(error).__name__} while timed: {error} "
                                                     f"at {shape_text(shape)}")
                        self._emit("rejected", op, candidate.backend, candidate.reason)
                        continue
                    candidate.samples.setdefault(index, []).extend(times[candidate.backend])
                    candidate.rounds.setdefault(index, []).append(list(times[candidate.backend]))
                    done += 1
                    self._emit("progress", op, candidate.backend, shape_text(shape), done / total)
                del base, calls
            alive = [c for c in alive if c.status == "ok"]
            if len(alive) > 1 and round_index == 0:
                self._drop_far_behind(op, alive, len(shapes))
                alive = [c for c in alive if c.status == "ok"]
            if not alive:
                return
            if time.perf_counter() - timing_began > self.budget_s and round_index + 1 < self.rounds:
                log.info("tune %s: budget of %.0f s reached after %d of %d rounds", op, self.budget_s,
                         round_index + 1, self.rounds)
                break

    def _drop_far_behind(self, op: str, alive: list[_Candidate], n_shapes: int) -> None:
        scores = _scores(alive, n_shapes)
        best = min(scores.values())  # relative to the best score, so the leader itself is never dropped
        for candidate in alive:
            behind = scores[candidate.backend] / best
            if behind > self.drop_factor:
                candidate.reject("dropped", f"dropped after the first round: {behind:.2f}x "
                                            f"the best candidate's time (threshold {self.drop_factor:g}x)")
                self._emit("dropped", op, candidate.backend, candidate.reason)

    def _decide(self, definition, candidates, shapes, *, mode, platform_key, versions, bucket, tune_s,
                autosel_version) -> Decision:
        op = definition.op
        measured = [c for c in candidates if c.status == "ok"]
        if not measured:
            reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates)
            raise TuningError(f"op {op!r}: no candidate passed the checks ({reasons}); fix the kernels or "
                              "pass backend=... to choose one")
        timings = {c.backend: [summarize(c.samples[i], self.timer.method, c.rounds.get(i), c.splits.get(i))
                               if c.samples.get(i) else None for i in range(len(shapes))] for c in candidates}
        stats = {c.backend: timings[c.backend] for c in measured}
        verdict = judge(stats, self.margin_floor)  # stats in registration order: the first is the default
        scores, winner, margin = verdict.scores, verdict.winner, verdict.margin
        ranked = sorted(stats, key=lambda b: scores[b])
        runner_up = next((b for b in ranked if b != winner), None)
        per_shape = [(json.dumps(shape, sort_keys=True), verdict.shape_winners[i]) for i, shape in enumerate(shapes)]
        results = []
        for c in candidates:
            shape_results = tuple(
                ShapeResult(shape=dict(shape), max_abs_err=c.errors.get(i, (None, None))[0],
                            max_rel_err=c.errors.get(i, (None, None))[1], timing=timings[c.backend][i],
                            first_call_s=c.first_call_s.get(i))
                for i, shape in enumerate(shapes)
            )
            results.append(CandidateResult(backend=c.backend, status=c.status, reason=c.reason,
                                           score=scores.get(c.backend), shapes=shape_results))
        decision = Decision(
            op=op, mode=mode, bucket=bucket, winner=winner, platform_key=platform_key, versions=dict(versions),
            candidates=tuple(results), margin=margin, runner_up=runner_up,
            lead_over_runner_up=(scores[runner_up] / scores[winner] - 1.0) if runner_up else None,
            per_shape_winners=tuple(per_shape), method=self.timer.method, tune_s=tune_s,
            created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            autosel_version=autosel_version,
        )
        lead = f"lead over {runner_up} {decision.lead_over_runner_up:+.1%}, " if runner_up else ""
        self._emit("chosen", op, winner, f"{lead}noise margin {margin:.1%}", 1.0)
        return decision
