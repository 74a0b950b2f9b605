"""The decision rule as a value: what a challenger must win by, in which readings, to replace the default.

The tuner is handed a Policy (Tuner(policy=...)); replays of stored evidence under another rule build other
Policy values instead of overwriting module globals.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from autosel.decisions import Measurement


@dataclass(frozen=True)
class Rule:
    """What beating a candidate takes, per timing method (docs/TUNING.md section 4)."""

    floor: float  # the least margin, however quiet the measurements
    may_lose: int = 0  # readings a win may lose, when there are three or more
    # Among candidates level with the fastest, one whose host part of a call (its median over the op's shapes) is
    # more than this many times the lightest level candidate's goes after the other level ones (choose); None: no
    # such step.
    heavy_host: float | None = None


# The floors: how far two fresh tunes' ratios of the same two candidates moved apart on the H200 and on this
# project's CPU machine. Graph replay repeats to a few percent; 6%, not 5%, because autosel's Triton kernels
# under 2 us replay about 0.09 us (4-8% per round) behind the vendors' and that ratio sat on a 5% floor
# (docs/TUNING.md section 7). Eager calls of small shapes are host time, which moves with the host's load.
# A CPU round is often disturbed wholesale for one candidate (descheduled, OpenMP wake-ups), so there a win
# may lose one round of three.
#
# Eager ties pass over a candidate whose host part of a call is clearly heavier than the lightest tied candidate's
# (choose): an eager call costs the larger of its host and device time, so level over the representative shapes, a
# candidate with a heavier launch loses the launch-bound shapes routed to it. With triton first in registration order
# and its launch then twice flashinfer's on the host (9.9-11.1 against 5.4-5.8 us), a tie made it eager rmsnorm's
# op-level winner and held-out shapes ran at 1.25x the per-shape best against flashinfer's 1.10 (commit 2495846).
# With every Triton kernel launched from C triton's host part sits at 0.91-1.14x flashinfer's in every op but rope
# (flashinfer's 1.8-1.9x there) and sgl-kernel's at 1.27-1.48x the lightest: a cut at 1.5x gave triton ties it then
# lost at launch-bound shapes (up to 1.24x the per-shape best, commit 74efafc), and a cut of 1.13x lay inside the
# first cluster (commit c917452), and eager fused add +
# rmsnorm's op-level winner and all its 13 buckets changed hands between those tunes on a host ratio of 1.138 against
# 0.953. 1.2x lies between the clusters; a launch through Python (a torch without the DLPack C exchange API: 1.8-2x)
# is still passed over (docs/TUNING.md section 4). In graph mode the host's time is gone.
GRAPH_RULE = Rule(0.06)
# A timing method's suffix where each timed call read the op's weights from memory (OpDefinition.weights).
WEIGHTS_FROM_MEMORY = "weights from memory"
RULES = {"cuda:graph-replay, activations written": GRAPH_RULE,
         f"cuda:graph-replay, activations written, {WEIGHTS_FROM_MEMORY}": GRAPH_RULE,  # gemm.mm, since commit f981d83
         f"cuda:graph-replay, {WEIGHTS_FROM_MEMORY}": GRAPH_RULE,  # an op that declares no activations (attention)
         "cuda:back-to-back": Rule(0.10, heavy_host=1.2),
         "cpu:torch.utils.benchmark": Rule(0.05, may_lose=1),
         # graph replay as stored before activations were written (one input replayed as it was; commit 49a3813), and
         # before its blocks took turns
         "cuda:graph-replay": GRAPH_RULE, "cuda:do_bench_cudagraph": GRAPH_RULE}
DEFAULT_RULE = Rule(0.03)  # any other timer (tests' fake timers)
# How much slower or faster the host may run than while it was measured. The H200 machine's host ran in two
# states, the slow one about 1.6x slower (launch-bound calls moved up to 1.9x between processes a minute
# apart, commit de5ccee, and between two tunes: docs/TUNING.md section 4). Slower: 1.6x, from the fast
# state to the slow one. Faster: 1.25x only (1.33x and 1.43x replayed alike); a host 1.6x faster than a tune
# in the fast state had never been seen, yet that reading kept a pick 1.5x slower at every speed measured
# (rope, 6 of 13 runs flipped on it).
HOST_SLOWER, HOST_FASTER = 1.6, 1.25
HOST_SPEEDS = (1 / HOST_FASTER, HOST_SLOWER)  # the host-speed readings, as factors on the host's time


def geomean(values: Sequence[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def relative_scores(medians: dict[str, list[float]]) -> dict[str, float]:
    """Per candidate, the geometric mean over shapes of its time relative to the best candidate on that shape."""
    n_shapes = len(next(iter(medians.values())))
    best = [min(m[i] for m in medians.values()) for i in range(n_shapes)]
    return {b: geomean([m[i] / best[i] for i in range(n_shapes)]) for b, m in medians.items()}


def choose(order: Sequence[str], readings: dict[str, Sequence[float]], margin: float, may_lose: int = 0,
           hosts: Mapping[str, float] | None = None, heavy_host: float | None = None) -> str:
    """The first candidate in registration order that the fastest does not beat by more than `margin` in
    every reading (each round, each host speed), or in all but `may_lose` of three or more: the default
    keeps the decision unless beaten, and among candidates level with the fastest the earliest registered
    wins, so a near-tie cannot change hands between two tunes. The fastest: the lowest median reading.

    With `hosts` (each candidate's host part of a call) and `heavy_host`, a level candidate whose host part is
    over heavy_host times the lightest level candidate's comes after the other level ones (heavy_hosts), but for
    the first in `order` when the caller pins it there (a bucket's default: pass hosts without it)."""
    fastest = min(order, key=lambda b: statistics.median(readings[b]))

    def beaten(candidate: str) -> bool:
        wins = [t > f * (1.0 + margin) for t, f in zip(readings[candidate], readings[fastest], strict=True)]
        return sum(wins) >= (len(wins) - may_lose if len(wins) >= 3 else len(wins))

    level = [b for b in order if not beaten(b)]
    heavy = heavy_hosts(level, hosts or {}, heavy_host)
    return min(level, key=lambda b: b in heavy)  # the first of the lightest group, in order


def at_host_speed(m: Measurement, factor: float) -> float:
    """m's time had the host run `factor` times slower: an eager call costs the larger of its host and
    device parts, so only a launch-bound call moves with the host. m unchanged without those parts."""
    if not m.host_us or not m.device_us:
        return m.median_us
    return m.median_us * max(factor * m.host_us, m.device_us) / max(m.host_us, m.device_us)


def readings_of(m: Measurement, rounds: int, host_speeds: Sequence[float],
                pace: Sequence[float] = ()) -> list[float]:
    """The times a challenger must win in: the median of each of the first `rounds` rounds (the overall
    median if none), then the median at each host speed.

    A measurement of fewer rounds (a candidate the tuner stopped timing at a shape where it was far behind
    after the first) is carried into the rounds it sat out at its last ratio to the candidates still timed:
    `pace` is the shape's fastest fully timed candidate's round medians (pace_of). Without that scaling a
    round in which the machine slowed every call it timed (launch-bound calls at 1.6x on the H200) compared
    them with a reading from before the slowdown, and a candidate 1.7x behind kept four gelu_and_mul shapes.
    """
    by_round = list(m.round_medians_us[:rounds]) or [m.median_us]
    last = len(by_round) - 1
    paced = len(pace) == rounds > last and pace[last] > 0
    by_round += [by_round[last] * (pace[k] / pace[last] if paced else 1.0) for k in range(last + 1, rounds)]
    return by_round + [at_host_speed(m, f) for f in host_speeds]


def pace_of(measurements: Sequence[Measurement], rounds: int) -> tuple[float, ...]:
    """One shape's round medians of its fastest candidate timed in all `rounds` rounds (empty if none was): how
    the machine's speed moved from round to round there, for readings_of."""
    full = [m for m in measurements if len(m.round_medians_us) >= rounds]
    return tuple(min(full, key=lambda m: m.median_us).round_medians_us[:rounds]) if full else ()


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
    (two fresh tunes on a 2-core CPU: 24 of 28 decisions identical with it; 26, 25 and 27 of 28
    in three runs without it).
    """
    return 2 * relative_standard_error(m)


def typical_margin(measurements: Sequence[Measurement], floor: float) -> float:
    """The typical (median) noise of the measurements compared, never below the floor.

    The median over measurements, not the worst, so one disturbed shape does not freeze every decision.
    """
    return max(floor, statistics.median(noise(m) for m in measurements))


def heavy_hosts(level: Sequence[str], hosts: Mapping[str, float], factor: float | None) -> set[str]:
    """Of the candidates level with the fastest, those whose host part of a call is more than `factor` times the
    lightest of them: measured against the candidates in the tie only, so that a slower one, installed or not,
    cannot move a tie between two others. None without a factor, or unless every level candidate in `hosts` has
    its host part measured (CPU and graph timings have none; a bucket's pinned default is left out of hosts)."""
    compared = [b for b in level if b in hosts]
    if factor is None or len(compared) < 2 or any(not hosts[b] for b in compared):
        return set()
    lightest = min(hosts[b] for b in compared)
    return {b for b in compared if hosts[b] > factor * lightest}


def host_parts(stats: Mapping[str, Sequence[Measurement]]) -> dict[str, float] | None:
    """Each candidate's host part of a call, the median over its shapes; None unless every measurement has one."""
    if not all(m.host_us for ms in stats.values() for m in ms):
        return None
    return {b: statistics.median(m.host_us for m in ms) for b, ms in stats.items() if ms}


@dataclass(frozen=True)
class Verdict:
    scores: dict[str, float]  # relative_scores of the per-shape medians
    winner: str  # the winner over all the shapes judged
    margin: float  # the margin over all the shapes judged
    shape_winners: list[str]  # the winner of each shape, with that shape's own margin


@dataclass(frozen=True)
class Policy:
    """The decision rule's settings. rules: per timing method; host_speeds: the host-speed readings (factors
    on a call's host time); margin_floor: replaces every method's floor when set."""

    rules: Mapping[str, Rule] = field(default_factory=lambda: dict(RULES))
    default_rule: Rule = DEFAULT_RULE
    host_speeds: tuple[float, ...] = HOST_SPEEDS
    margin_floor: float | None = None

    def rule_for(self, method: str) -> Rule:
        return self.rules.get(method, self.default_rule)

    def with_floor(self, method: str, floor: float) -> "Policy":
        """This policy with `method`'s floor set, and that of every method sharing its rule (older names)."""
        if method not in self.rules:
            raise ValueError(f"no timing method {method!r}; one of {', '.join(self.rules)}")
        shared = self.rules[method]
        rule = dataclasses.replace(shared, floor=floor)
        return dataclasses.replace(self, rules={m: rule if r is shared else r for m, r in self.rules.items()})

    def with_heavy_host(self, factor: float | None) -> "Policy":
        """This policy with every heavy-host step's factor set (None: no such step), for replays of other rules."""
        return self._each_rule(lambda r: dataclasses.replace(r, heavy_host=factor) if r.heavy_host else r)

    def with_may_lose(self, may_lose: int) -> "Policy":
        return self._each_rule(lambda r: dataclasses.replace(r, may_lose=may_lose))

    def _each_rule(self, change) -> "Policy":
        """This policy with change(rule) for each rule, once per rule shared by several method names (older
        names), so that they stay one rule for with_floor."""
        changed: dict[int, Rule] = {}
        return dataclasses.replace(self, rules={m: changed.setdefault(id(r), change(r))
                                               for m, r in self.rules.items()})

    def judge(self, stats: dict[str, list[Measurement]], default: str | None = None,
              hosts: Mapping[str, float] | None = None) -> Verdict:
        """The decision, from each candidate's per-shape measurements (dict in registration order). Ties are
        broken in that order, or with `default` first; in the timing methods whose Rule has heavy_host, a level
        candidate with a heavy host part comes after the other level ones (choose), but for `default`. hosts: each
        candidate's host part of a call (default: host_parts of stats). A call's host part hardly depends on its
        shape, so one figure per candidate over all of an op's shapes serves its buckets too, steadier than
        their one or two shapes' own.

        To beat a candidate, the fastest must win every reading (but those the timing method's Rule lets it
        lose): each interleaved round (rounds compared pairwise, measured close in time) and, where a call's
        host and device parts were measured, the host at each of host_speeds (faster and slower).
        """
        everything = [m for ms in stats.values() for m in ms]
        rule = self.rule_for(everything[0].method)
        order = sorted(stats, key=lambda b: b != default)  # a stable sort: registration order, the default first

        # The host parts the heavy-host step compares: every candidate's but the default's, never passed over.
        parts = host_parts(stats) if hosts is None else hosts
        parts = parts and {b: h for b, h in parts.items() if b != default}
        floor = rule.floor if self.margin_floor is None else self.margin_floor
        rounds = max(len(m.round_medians_us) for m in everything)
        speeds = self.host_speeds if all(m.host_us and m.device_us for m in everything) else ()
        n_shapes = len(stats[order[0]])
        paces = [pace_of([stats[b][i] for b in order], rounds) for i in range(n_shapes)]
        per_shape = {b: [readings_of(m, rounds, speeds, paces[i]) for i, m in enumerate(ms)]
                     for b, ms in stats.items()}
        n_readings = len(per_shape[order[0]][0])
        # Over several shapes: each reading's relative score (geometric mean against the best per shape).
        op_readings = {b: [] for b in order}
        for k in range(n_readings):
            for b, score in relative_scores({b: [r[k] for r in rs] for b, rs in per_shape.items()}).items():
                op_readings[b].append(score)
        scores = relative_scores({b: [m.median_us for m in ms] for b, ms in stats.items()})
        margin = typical_margin(everything, floor)
        shape_winners = [choose(order, {b: per_shape[b][i] for b in order},
                                typical_margin([stats[b][i] for b in order], floor), rule.may_lose,
                                parts, rule.heavy_host)
                         for i in range(n_shapes)]
        winner = choose(order, op_readings, margin, rule.may_lose, parts, rule.heavy_host)
        return Verdict(scores, winner, margin, shape_winners)

    def judge_groups(self, stats: dict[str, list[Measurement]], groups: Mapping[object, Sequence[int]],
                     default: str | None) -> dict[object, Verdict]:
        """One verdict per group of shape indices (a shape bucket), by the same rule on that group's shapes, with
        `default` (the op-level winner) as each group's default: it is kept unless beaten by more than the margin
        in every reading at that group's shapes. With registration order instead, a near-tie at one shape handed
        the bucket to an earlier-registered backend (triton before the vendors) that lost by 1.8x on the
        held-out shapes routed to it (H200, eager rmsnorm; docs/BENCHMARKS.md). `default` None: each group's
        fastest (the least relative score over its shapes) is its default, so a near-tie goes to the faster."""
        hosts = host_parts(stats)
        verdicts = {}
        for g, idx in groups.items():
            group = {b: [ms[i] for i in idx] for b, ms in stats.items()}
            scores = relative_scores({b: [m.median_us for m in ms] for b, ms in group.items()})
            verdicts[g] = self.judge(group, default=default or min(scores, key=scores.get), hosts=hosts)
        return verdicts


DEFAULT_POLICY = Policy()


def rule_for(method: str) -> Rule:
    """The default policy's rule for a timing method."""
    return DEFAULT_POLICY.rule_for(method)


def judge(stats: dict[str, list[Measurement]], margin_floor: float | None = None) -> Verdict:
    """The default policy's verdict (margin_floor: replaces the method's floor)."""
    policy = DEFAULT_POLICY if margin_floor is None else dataclasses.replace(DEFAULT_POLICY, margin_floor=margin_floor)
    return policy.judge(stats)
