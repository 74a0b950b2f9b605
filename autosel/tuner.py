"""The tuning loop: check every candidate against the reference, time the correct ones in interleaved rounds, choose with a noise margin."""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from autosel import checks
from autosel.buckets import bucket_of
from autosel.decisions import OP_LEVEL_BUCKET, CandidateResult, Decision, ShapeResult, bucket_text
from autosel.errors import NoCandidateError, TuningError
from autosel.formatting import format_lead, shape_text
from autosel.planned import kernel_of, prepare, run_args
from autosel.policy import DEFAULT_POLICY, WEIGHTS_FROM_MEMORY, Policy, Verdict, relative_scores
from autosel.spec import KernelSpec, OpDefinition
from autosel.timing import ACTIVATIONS_WRITTEN, Timer, measure_together, reads_weights, summarize

log = logging.getLogger(__name__)

# After the first round, a candidate this many times slower than the best (geometric mean over the shapes) is
# dropped, unless it was the fastest at some shape.
DROP_FACTOR = 3.0
# After the first round, a candidate this many times slower than a shape's fastest is not timed there again (it
# is settled there): it is carried into the later rounds at its first round's ratio (policy.readings_of). A warm
# whole tune on the H200 timed 13-14% fewer measurements, and replayed on five stored H200 tunes (1,280
# decisions) 1.2x and 1.3x left every decision as judged on all rounds (commit 8c78c9d).
SETTLED_FACTOR = 1.3
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
    device: str = ""  # which worker's GPU ("cuda:1") when autosel.parallel spreads the tune; else empty


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
    plan_us: dict[int, list[float]] = field(default_factory=dict)  # planned ops: shape index -> plan-building times
    unsupported: dict[int, str] = field(default_factory=dict)  # planned ops: shape index -> why it cannot run it

    @property
    def backend(self) -> str:
        return self.spec.backend.value

    def reject(self, status: str, reason: str) -> None:
        self.status, self.reason = status, reason


def _shared(candidates: list[_Candidate], n_shapes: int) -> list[int]:
    """The shape indices every candidate runs: all of them, but where a planned op's backend cannot run a shape."""
    return [i for i in range(n_shapes) if not any(i in c.unsupported for c in candidates)]


def _scores(candidates: list[_Candidate], n_shapes: int) -> dict[str, float]:
    return relative_scores({c.backend: [statistics.median(c.samples[i]) for i in _shared(candidates, n_shapes)]
                            for c in candidates})


class Tuner:
    """Tunes one op on one device in one execution mode. The timer is injected (tests pass a fake)."""

    def __init__(self, *, timer: Timer, device: str, rounds: int = ROUNDS, policy: Policy = DEFAULT_POLICY,
                 drop_factor: float = DROP_FACTOR, settled_factor: float = SETTLED_FACTOR, budget_s: float = 30.0,
                 seed: int = 0, on_event: Callable[[TuneEvent], None] | None = None,
                 isolate_timeout_s: float | None = None) -> None:
        """policy: the decision rule (autosel.policy).
        settled_factor: after the first round, a candidate this far behind a shape's best is not timed there again.
        isolate_timeout_s: check each candidate first in a child process that is killed after this long."""
        self.timer, self.device, self.rounds, self.policy = timer, device, rounds, policy
        self.isolate_timeout_s = isolate_timeout_s
        self._mode = ""  # of the tune in progress, for events
        self.drop_factor, self.settled_factor, self.budget_s, self.seed = drop_factor, settled_factor, budget_s, seed
        self.on_event = on_event or (lambda event: None)

    def tune(self, definition: OpDefinition, specs: Sequence[KernelSpec], *, reference: Callable[..., Any],
             shapes: Sequence[dict], mode: str, platform_key: str, versions: dict[str, str],
             autosel_version: str = "") -> Decision:
        """The op-level decision (tune_buckets also gives the per-bucket ones)."""
        return self.tune_buckets(definition, specs, reference=reference, shapes=shapes, mode=mode,
                                 platform_key=platform_key, versions=versions, autosel_version=autosel_version)[0]

    def tune_buckets(self, definition: OpDefinition, specs: Sequence[KernelSpec], *, reference: Callable[..., Any],
                     shapes: Sequence[dict], mode: str, platform_key: str, versions: dict[str, str],
                     autosel_version: str = "", check_shapes: Sequence[dict] = ()) -> tuple[Decision, list[Decision]]:
        """The op-level decision and, when the op declares a bucket function, one decision per shape bucket
        that the shapes cover, each judged by the same rule on its own shapes' measurements.
        check_shapes: shapes every candidate must also match the reference on before it is timed, though they are
        not timed (the op's representative shapes, when `shapes` are recorded ones): a candidate wrong at one of
        them is rejected, so that no bucket the timed shapes leave out runs it."""
        op, started, self._mode = definition.op, time.perf_counter(), mode
        if not shapes:
            raise TuningError(f"op {op!r} has no representative shapes to tune on; pass shapes= to register_op")
        self._emit("started", op, detail=f"{len(specs)} candidates, {len(shapes)} shapes, {mode} mode")
        candidates = [self._load(_Candidate(spec), definition) for spec in specs]
        for candidate in candidates:
            if candidate.fn is None:
                self._emit("rejected", op, candidate.backend, candidate.reason or "")
        checked = _with_check_shapes(shapes, check_shapes)
        if self.isolate_timeout_s is not None:
            self._probe_isolated(definition, candidates, reference, checked)
        self._check(definition, candidates, reference, checked)
        # The budget bounds the timing rounds; the checks before them (which absorb compilation) are bounded
        # by one call per candidate and shape, and reported per shape as first_call_s.
        buckets = self._time(definition, [c for c in candidates if c.status == "ok"], shapes, time.perf_counter())
        self._check_after_timing(definition, candidates, reference, shapes)
        return self._decide(definition, candidates, shapes, buckets, mode=mode, platform_key=platform_key,
                            versions=versions, tune_s=time.perf_counter() - started,
                            autosel_version=autosel_version)

    def _emit(self, kind: str, op: str, backend: str | None = None, detail: str = "", fraction: float = 0.0):
        log.debug("tune %s %s %s %s", op, kind, backend or "", detail)
        self.on_event(TuneEvent(kind, op, backend, detail, fraction, self._mode))

    def _load(self, candidate: _Candidate, definition: OpDefinition) -> _Candidate:
        try:
            candidate.fn = kernel_of(definition, candidate.spec.load())
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
            report = checks.check_candidate(candidate.fn, definition, reference, shapes, device=self.device, seed=self.seed)
            candidate.errors, candidate.first_call_s = report.errors, report.first_call_s
            candidate.unsupported = report.unsupported
            if not report.reason and len(report.unsupported) == len(shapes):
                report.reason = f"runs none of the shapes; {next(iter(report.unsupported.values()))}"
            if report.reason:
                candidate.reject("rejected", report.reason)
                self._emit("rejected", definition.op, candidate.backend, candidate.reason)

    def _check_after_timing(self, definition: OpDefinition, candidates: list[_Candidate], reference, shapes) -> None:
        """Every timed candidate must still match the reference once its timed calls are done: a kernel whose outputs
        turn NaN (or wrong) only after its first calls passed the check before timing, was timed and was stored
        with status ok. The same check on the same seeded inputs, after the last timed call."""
        for candidate in candidates:
            if candidate.status != "ok" or not candidate.samples:
                continue
            report = checks.check_candidate(candidate.fn, definition, reference, shapes, device=self.device,
                                            seed=self.seed)
            if report.reason:
                candidate.reject("rejected", f"wrong after its timed calls: {report.reason}")
                self._emit("rejected", definition.op, candidate.backend, candidate.reason)

    def _time(self, definition: OpDefinition, alive: list[_Candidate], shapes, timing_began: float) -> list:
        """Interleaved rounds: in each, every shape's candidates are timed together, block by block in turn
        (timing.measure_together), and the order rotates each round so no one always goes first. After the first
        round, a candidate far behind at a shape (settled_factor) sits out that shape's later rounds. Returns each
        shape's bucket (definition.bucket of the inputs built for it; None without a bucket function).

        One shape's inputs exist at a time (rebuilt from the same seed each round), each candidate on its own
        copies: one, or as many as the timer's rotate_bytes asks for.
        """
        buckets: list = [None] * len(shapes)
        if not alive:
            return buckets
        import torch

        op, total, done = definition.op, self.rounds * len(shapes) * len(alive), 0
        self._emit("timing", op, detail=f"{len(alive)} candidates, up to {self.rounds} rounds")
        rotate_bytes = getattr(self.timer, "rotate_bytes", 0)
        split = getattr(self.timer, "host_and_device_us", None)
        writes = getattr(self.timer, "writes_activations", False)
        subtract = writes and bool(definition.activations)  # nothing written: no writes' time to take off
        weight_bytes = getattr(self.timer, "weight_bytes", 0)
        settled: set[tuple[str, int]] = set()  # (backend, shape index) pairs no later round times
        routes: dict[tuple, tuple] = {}  # with a route_key: the route's argument shapes -> their bucket
        for round_index in range(self.rounds):
            shift = round_index % len(alive)
            order = alive[shift:] + alive[:shift]
            for index, shape in enumerate(shapes):
                torch.manual_seed(self.seed + 1000 + index)
                base = definition.make_inputs(dict(shape), self.device)
                if round_index == 0 and definition.bucket is not None:
                    buckets[index] = bucket_of(definition, base)
                    _check_route(definition, base, buckets[index], routes)
                    _one_type_per_bucket(op, buckets)
                timed = [c for c in order if c.status == "ok" and (c.backend, index) not in settled
                         and index not in c.unsupported]
                if round_index > 0 and len(timed) < 2:  # the shape's winner is settled
                    continue
                prepared, failed_plans = self._prepare(definition, timed, base, index)
                if writes:
                    calls = {b: _after_writing(fn, definition.activations, args, definition.weights, weight_bytes)
                             for b, (fn, args) in prepared.items()}
                    if subtract:
                        calls[WRITES] = _after_writing(None, definition.activations, run_args(definition, base))
                else:
                    calls = {b: checks.rotating_call(fn, args, rotate_bytes) for b, (fn, args) in prepared.items()}
                times, failed = measure_together(self.timer, calls, shape=shape)
                failed.update(failed_plans)
                if subtract:
                    times = _less_writes(times, failed, op, shape)
                for candidate in timed:
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
                settled = self._settled(alive, len(shapes))
            if not alive:
                break
            if time.perf_counter() - timing_began > self.budget_s and round_index + 1 < self.rounds:
                log.info("tune %s: budget of %.0f s reached after %d of %d rounds", op, self.budget_s,
                         round_index + 1, self.rounds)
                break
        return buckets

    def _prepare(self, definition: OpDefinition, timed: list[_Candidate], base: tuple, index: int
                 ) -> tuple[dict[str, tuple], dict[str, BaseException]]:
        """Per candidate, what its timed calls run and on what: a planned op's plan is built here, outside the
        timed region, and the time that took kept as evidence (autosel.planned). A plan that raises is the
        candidate's failure, as a call that raises while timed is."""
        prepared, failed = {}, {}
        for candidate in timed:
            try:
                fn, args, plan_us = prepare(definition, candidate.fn, base, self.device)
            except (Exception, SystemExit) as exc:
                failed[candidate.backend] = exc
                continue
            prepared[candidate.backend] = (fn, args)
            if plan_us is not None:
                candidate.plan_us.setdefault(index, []).append(plan_us)
        return prepared, failed

    def _settled(self, alive: list[_Candidate], n_shapes: int) -> set[tuple[str, int]]:
        """settled_pairs of the first round's per-shape medians."""
        return settled_pairs({c.backend: [math.inf if i in c.unsupported else statistics.median(c.samples[i])
                                          for i in range(n_shapes)] for c in alive},
                             self.settled_factor)

    def _drop_far_behind(self, op: str, alive: list[_Candidate], n_shapes: int) -> None:
        """Drop candidates far behind over all shapes, except one that was the fastest at some shape: it may
        win that shape's bucket."""
        if not _shared(alive, n_shapes):  # no shape that every candidate runs: nothing to compare them on
            return
        scores = _scores(alive, n_shapes)
        best = min(scores.values())  # relative to the best score, so the leader itself is never dropped
        leaders = {min((c for c in alive if i not in c.unsupported), key=lambda c: statistics.median(c.samples[i])
                       ).backend for i in range(n_shapes)}
        for candidate in alive:
            behind = scores[candidate.backend] / best
            if behind > self.drop_factor and candidate.backend not in leaders:
                candidate.reject("dropped", f"dropped after the first round: {behind:.2f}x "
                                            f"the best candidate's time (threshold {self.drop_factor:g}x)")
                self._emit("dropped", op, candidate.backend, candidate.reason)

    def _method(self, definition: OpDefinition) -> str:
        """How the op was timed, as its evidence names it: the timer's method, and whether each call read the op's
        weights from memory (OpDefinition.weights, under a timer that reads_weights); a timer that writes activations
        names no writes for an op that declares none."""
        method = self.timer.method
        if getattr(self.timer, "writes_activations", False) and not definition.activations:
            method = method.removesuffix(f", {ACTIVATIONS_WRITTEN}")
        if definition.weights and reads_weights(self.timer):
            return f"{method}, {WEIGHTS_FROM_MEMORY}"
        return method

    def _decide(self, definition, candidates, shapes, buckets, *, mode, platform_key, versions, tune_s,
                autosel_version) -> tuple[Decision, list[Decision]]:
        op = definition.op
        measured = [c for c in candidates if c.status == "ok"]
        if not measured:
            reasons = "; ".join(f"{c.backend}: {c.reason}" for c in candidates)
            raise NoCandidateError(f"op {op!r}: no candidate passed the checks ({reasons})")
        method = self._method(definition)
        timings = {c.backend: [summarize(c.samples[i], method, c.rounds.get(i), c.splits.get(i))
                               if c.samples.get(i) else None for i in range(len(shapes))] for c in candidates}
        stats = {c.backend: timings[c.backend] for c in measured}  # registration order: the policy's tie-break
        common = dict(mode=mode, platform_key=platform_key, versions=dict(versions), method=method,
                      tune_s=tune_s, autosel_version=autosel_version, checked_with=definition.checked_with,
                      created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        # A planned op's backend that cannot run some shapes (its supports) competes only where it runs all of a
        # decision's shapes: the op-level winner, which untuned buckets run, must run every tuned one.
        everywhere = {b: ms for b, ms in stats.items() if all(m is not None for m in ms)}
        if not everywhere:
            raise NoCandidateError(f"op {op!r}: no candidate runs every shape ("
                                   + "; ".join(f"{c.backend}: {next(iter(c.unsupported.values()), c.reason)}"
                                               for c in candidates) + ")")
        verdict = self.policy.judge(everywhere)
        decision = _decision(op, OP_LEVEL_BUCKET, verdict, candidates, timings, shapes, range(len(shapes)), common)
        groups: dict = {}
        for i, key in enumerate(buckets):
            if key is not None:
                groups.setdefault(key, []).append(i)
        # A planned op's buckets in graph mode keep their own fastest through a near-tie, not the op-level winner:
        # attention's backends parted further on held-out batches than in the tune's readings of small batches, and
        # the op-level winner kept through ties there was led beyond the margin on twice as many held-out batches, on
        # the H200 and the H100 (dev/attention_route_whatif.py). Eager keeps the op-level winner: there a bucket's
        # fastest ran up to 2.3x behind, a tie being often the host's noise.
        default = None if definition.planned and mode == "graph" else decision.winner
        if len(everywhere) == len(stats):
            verdicts = self.policy.judge_groups(stats, groups, default=default)
        else:
            verdicts = {key: self.policy.judge_groups(
                {b: [ms[i] for i in idx] for b, ms in stats.items() if all(ms[i] is not None for i in idx)},
                {key: range(len(idx))}, default=default)[key] for key, idx in groups.items()}
        per_bucket = [_decision(op, bucket_text(key), v, candidates, timings, shapes, groups[key], common)
                      for key, v in verdicts.items()]
        lead = "" if not decision.runner_up else (
            f"lead over {decision.runner_up} {format_lead(decision)}, " if decision.lead_over_runner_up >= 0
            else f"over {decision.runner_up}: {format_lead(decision)}; ")  # in words: the default kept
        differ = sum(d.winner != decision.winner for d in per_bucket)
        buckets_text = (f", {len(per_bucket)} bucket{'s' if len(per_bucket) != 1 else ''} ({differ} with another "
                        "winner)") if per_bucket else ""
        self._emit("chosen", op, decision.winner, f"{lead}noise margin {decision.margin:.1%}{buckets_text}", 1.0)
        return decision, per_bucket


WRITES = "(activations written)"  # the writes alone, timed with the candidates of a timer that writes_activations


def _after_writing(fn: Callable[..., Any] | None, activations: Sequence[int], base: Sequence[Any],
                   weights: Sequence[int] = (), weight_bytes: int = 0) -> Callable[[], Any]:
    """A call of fn on its own copy of base that first writes the copy's activations (OpDefinition.activations)
    from copies of their values, as the ops before it write them in a model; with fn None, the writes alone. An
    in-place kernel so finds its inputs as made at every call. With `weights` (OpDefinition.weights) and
    weight_bytes, each call takes the next of its own copies of those arguments, enough to hold weight_bytes, so
    that they are read from memory as a model reads a layer's weights."""
    import torch

    args = checks.clone_args(base)
    pairs = [(args[i], args[i].clone()) for i in activations if i < len(args) and isinstance(args[i], torch.Tensor)]
    weights = [i for i in weights if i < len(args) and isinstance(args[i], torch.Tensor)]
    copies = [args]
    if fn is not None and weights and weight_bytes:
        copies = [tuple(own[weights.index(i)] if i in weights else arg for i, arg in enumerate(args))
                  for own in checks.rotating_copies([args[i] for i in weights], weight_bytes)]
    cycle = itertools.cycle(copies)

    def call():
        for arg, value in pairs:
            arg.copy_(value)
        return None if fn is None else fn(*next(cycle))
    return call


def _less_writes(times: dict[str, list[float]], failed: dict[str, BaseException], op: str,
                 shape: dict) -> dict[str, list[float]]:
    """Each candidate's samples less the writes' sample of the same block (measure_together takes the blocks in
    turn, so the two are close in time). A sample at or below the writes' is a measurement that cannot tell the
    call from nothing: kept at 1 ns."""
    if WRITES in failed:
        raise TuningError(f"op {op!r}: writing its activations before each timed call raised at "
                          f"{shape_text(shape)}: {failed[WRITES]}")
    writes = times.pop(WRITES)
    return {backend: [max(t - w, 1e-3) for t, w in zip(samples, writes)] for backend, samples in times.items()}


def _with_check_shapes(shapes: Sequence[dict], check_shapes: Sequence[dict]) -> list[dict]:
    """The timed shapes first, at the indices (and check seeds) the decision's evidence gives them, then each check
    shape not among them."""
    checked, seen = list(shapes), {json.dumps(shape, sort_keys=True) for shape in shapes}
    for shape in check_shapes:
        text = json.dumps(shape, sort_keys=True)
        if text not in seen:
            seen.add(text)
            checked.append(shape)
    return checked


def settled_pairs(first_round: dict[str, list[float]], factor: float) -> set[tuple[str, int]]:
    """(backend, shape index) pairs where the first round (each backend's median per shape) left the backend more
    than `factor` times the shape's fastest: no later round would make it that shape's winner."""
    n_shapes = len(next(iter(first_round.values()), []))
    best = [min(times[i] for times in first_round.values()) for i in range(n_shapes)]
    return {(b, i) for b, times in first_round.items() for i in range(n_shapes) if times[i] > factor * best[i]}


def _one_type_per_bucket(op: str, buckets: list) -> None:
    """Keys that Python takes for one bucket, stored as two ((True,) and (1,), (1,) and (1.0,)): a dict of them
    kept one and the DB both, so that calls ran another bucket's winner than the one stored for them."""
    seen: dict[tuple, str] = {}
    for key in buckets:
        if key is None:
            continue
        text = bucket_text(key)
        first = seen.setdefault(key, text)
        if first != text:
            raise TuningError(f"op {op!r}: its bucket function returned {first} and {text}, which Python takes for "
                              "one bucket (True == 1 == 1.0); return the same type at each place of the key (a bool "
                              "for a flag, an int for a count)")
def _check_route(definition: OpDefinition, args: tuple, bucket: tuple, routes: dict[tuple, tuple]) -> None:
    """With a route_key, calls whose route arguments have one shape must fall in one bucket: the dispatcher looks
    calls up by those shapes alone, and a wrong route_key sent calls to another bucket's winner, silently."""
    if definition.route_key is None:
        return
    indices = definition.route_key if isinstance(definition.route_key, tuple) else (definition.route_key,)
    route = tuple(tuple(getattr(args[i], "shape", ())) for i in indices)
    seen = routes.setdefault(route, bucket)
    if seen != bucket:
        raise TuningError(f"op {definition.op!r}: route_key={definition.route_key!r} does not decide the bucket: two "
                          f"shapes whose argument {', '.join(map(str, indices))} has the shape {route} fall in buckets "
                          f"{seen} and {bucket}; name the argument(s) whose shape decides the bucket, or pass none")


def _decision(op: str, bucket: str, verdict: Verdict, candidates: list[_Candidate], timings: dict, shapes,
              indices, common: dict) -> Decision:
    """One row: the verdict on the shapes at `indices`, with every candidate's evidence on those shapes."""
    winner, scores = verdict.winner, verdict.scores
    runner_up = min((b for b in scores if b != winner), key=scores.get, default=None)
    results = []
    for c in candidates:
        shape_results = tuple(
            ShapeResult(shape=dict(shapes[i]), max_abs_err=c.errors.get(i, (None, None))[0],
                        max_rel_err=c.errors.get(i, (None, None))[1], timing=timings[c.backend][i],
                        first_call_s=c.first_call_s.get(i),
                        plan_us=statistics.median(c.plan_us[i]) if c.plan_us.get(i) else None)
            for i in indices
        )
        status, reason = c.status, c.reason
        cannot = [c.unsupported[i] for i in indices if i in c.unsupported]
        if status == "ok" and cannot:  # ineligible for this decision's shapes, with the reason, never wrong
            status, reason = "unsupported", cannot[0]
        results.append(CandidateResult(backend=c.backend, status=status, reason=reason,
                                       score=scores.get(c.backend), shapes=shape_results))
    return Decision(
        op=op, bucket=bucket, winner=winner, candidates=tuple(results), margin=verdict.margin, runner_up=runner_up,
        lead_over_runner_up=(scores[runner_up] / scores[winner] - 1.0) if runner_up else None,
        per_shape_winners=tuple((json.dumps(shapes[i], sort_keys=True), w) for i, w in zip(indices, verdict.shape_winners)),
        **common,
    )
