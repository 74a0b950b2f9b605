"""The tuner's decision logic, driven by a fake timer with seeded noise (deterministic), and by the real CPU timer."""

from __future__ import annotations

import dataclasses
import random
import statistics
import sys
from pathlib import Path

import pytest
import torch

from autosel.checks import rotating_copies
from autosel.errors import TuningError
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition
from autosel.timing import CpuTimer, SamplingTimer, block_sampler, common_drift_removed, measure_together
from autosel.policy import choose, judge
from autosel.tuner import Tuner

HERE = Path(__file__).parent
OP = "toy.double"


class FakeTimer:
    """Per-backend base times (us) times per-shape factors, with seeded multiplicative noise; records call order."""

    method = "fake"

    def __init__(self, base_us: dict[str, float], *, noise: float = 0.01, seed: int = 0, samples: int = 20,
                 shape_factor: dict[tuple[str, int], float] | None = None):
        self.base_us, self.noise, self.samples = base_us, noise, samples
        self.shape_factor = shape_factor or {}
        self.rng = random.Random(seed)
        self.calls: list[tuple[str, int]] = []

    def measure(self, fn, *, backend, shape):
        self.calls.append((backend, shape["n"]))
        base = self.base_us[backend] * self.shape_factor.get((backend, shape["n"]), 1.0)
        return [base * (1 + self.rng.gauss(0, self.noise)) for _ in range(self.samples)]


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    import toy_kernels

    definition = OpDefinition(OP, shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs)
    return definition, toy_kernels


def specs(**targets):
    return [KernelSpec(OP, B(backend), f"toy_kernels:{target}") for backend, target in targets.items()]


def run(definition, toy_kernels, candidates, timer, **kwargs):
    tuner = Tuner(timer=timer, device="cpu", **kwargs)
    return tuner.tune(definition, candidates, reference=toy_kernels.fast, shapes=toy_kernels.SHAPES, mode="eager",
                      platform_key="cpu/test", versions={"torch": "x"})


@pytest.mark.parametrize("challenger_us, expected", [
    (100.0, "torch"),   # equal: the default keeps it
    (98.0, "torch"),    # 2% faster: inside the 3% floor
    (90.0, "triton"),   # 10% faster: outside the margin
])
def test_challenger_must_beat_the_default_by_more_than_the_margin(toy, challenger_us, expected):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": challenger_us}, noise=0.001)
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    assert decision.winner == expected
    assert decision.margin == pytest.approx(0.03, abs=0.005)


def test_noise_widens_the_margin(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 94.0}, noise=0.2, seed=3, samples=3)
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    # 20% gaussian noise and 9 samples: the median's standard error is about 8%, the margin twice that.
    assert 0.1 < decision.margin < 0.3
    assert decision.winner == "torch"
    quiet = run(definition, kernels, specs(torch="fast", triton="fast"),
                FakeTimer({"torch": 100.0, "triton": 94.0}, noise=0.2, seed=3, samples=400))
    assert quiet.margin < 0.06 and quiet.winner == "triton"  # more samples, smaller error, a real 6% win


def test_rounds_are_interleaved_and_rotated(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 90.0, "jit": 95.0})
    run(definition, kernels, specs(torch="fast", triton="fast", jit="fast"), timer, rounds=2)
    n1, n2 = kernels.SHAPES[0]["n"], kernels.SHAPES[1]["n"]
    assert timer.calls == [
        ("torch", n1), ("triton", n1), ("jit", n1), ("torch", n2), ("triton", n2), ("jit", n2),
        ("triton", n1), ("jit", n1), ("torch", n1), ("triton", n2), ("jit", n2), ("torch", n2),
    ]


def test_far_behind_candidates_are_dropped_after_the_first_round(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 400.0}, noise=0.0001)
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer, rounds=3)
    dropped = decision.candidate("triton")
    assert dropped.status == "dropped" and "4.00x the best" in dropped.reason
    assert [b for b, _ in timer.calls].count("triton") == 2  # only the first round's two shapes


def test_budget_stops_after_the_first_round(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 90.0})
    run(definition, kernels, specs(torch="fast", triton="fast"), timer, rounds=5, budget_s=0.0)
    assert len(timer.calls) == 4  # one round: 2 candidates x 2 shapes


def test_judge_replays_the_rule_on_stored_measurements():
    from autosel.decisions import Measurement

    def m(us):
        return Measurement(median_us=us, p20_us=us, p80_us=us, samples=30, method="stored")

    stats = {"torch": [m(100.0), m(100.0)], "triton": [m(97.0), m(50.0)]}  # 3% behind on one shape, 2x on the other
    verdict = judge(stats, margin_floor=0.05)
    assert verdict.shape_winners == ["torch", "triton"]  # inside a 5% floor the default keeps the first shape
    assert verdict.winner == "triton" and verdict.margin == 0.05
    assert judge(stats, margin_floor=0.01).shape_winners == ["triton", "triton"]


def test_budget_counts_from_the_first_timed_call_not_from_compilation(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 90.0})
    decision = run(definition, kernels, specs(torch="fast", triton="compiles_first"), timer, rounds=3, budget_s=0.3)
    assert len(timer.calls) == 12  # all three rounds, though the check (with its 0.5 s "compile") outlasted 0.3 s
    assert decision.candidate("triton").shapes[0].first_call_s >= 0.5


def test_the_event_hook_tells_every_step_of_a_tune(toy):
    definition, kernels = toy
    events = []
    timer = FakeTimer({"torch": 100.0, "triton": 50.0, "jit": 400.0, "aot": 1.0})
    decision = run(definition, kernels, specs(torch="fast", triton="fast", jit="fast", aot="nan"), timer,
                   on_event=events.append)
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["started", "rejected", "timing"] and kinds[-1] == "chosen"
    assert events[1].backend == "aot" and "NaN" in events[1].detail
    assert [(e.kind, e.backend) for e in events if e.kind == "dropped"] == [("dropped", "jit")]
    fractions = [e.fraction for e in events if e.kind == "progress"]
    assert fractions == sorted(fractions) and 0 < fractions[0] and fractions[-1] <= 1.0
    assert len(fractions) == len(timer.calls)  # one per candidate measured at one shape
    assert events[-1].backend == decision.winner == "triton" and all(e.op == OP for e in events)
    assert {e.mode for e in events} == {"eager"}


def test_the_chosen_event_words_a_default_kept_inside_the_noise(toy):
    # The "chosen" event said "lead over triton -2.0%" when the faster runner-up did not beat the default.
    from autosel.formatting import format_lead

    definition, kernels = toy
    events = []
    decision = run(definition, kernels, specs(torch="fast", triton="fast"),
                   FakeTimer({"torch": 100.0, "triton": 98.0}, noise=0.001), on_event=events.append)
    assert decision.winner == "torch" and decision.lead_over_runner_up < 0
    detail = events[-1].detail
    assert detail.startswith(f"over triton: {format_lead(decision)}; noise margin ")
    assert format_lead(decision).startswith("default kept: runner-up 2.0% faster") and "-2.0%" not in detail


def test_a_timer_that_writes_activations_has_every_timed_call_find_them_as_made(toy):
    # Replaying a call on inputs left as the last call left them put a gated activation whose input and output
    # fill the L2 1.07-1.27x behind flashinfer, where a model's MLP has it ahead (commit 49a3813).
    _, kernels = toy

    class WritingTimer(CpuTimer):  # as CudaGraphTimer does, on this CPU
        writes_activations = True

    definition = OpDefinition(OP, shapes=[{"n": 1}], make_inputs=kernels.big_activation, activations=(0,))
    candidates = [KernelSpec(OP, B(b), "toy_kernels:head_in_place") for b in ("torch", "triton")]

    def tune(timer):
        kernels.CALLS_ON_X_AS_MADE.clear()
        return Tuner(timer=timer, device="cpu").tune(definition, candidates, reference=kernels.head_in_place,
                                                     shapes=[{"n": 1}], mode="eager", platform_key="cpu/test",
                                                     versions={})

    tune(CpuTimer(blocks=5))
    assert not all(kernels.CALLS_ON_X_AS_MADE)  # a call found the change the last one made
    written = tune(WritingTimer(blocks=5))
    assert len(kernels.CALLS_ON_X_AS_MADE) > 10 and all(kernels.CALLS_ON_X_AS_MADE)
    assert sorted(c.backend for c in written.candidates) == ["torch", "triton"]  # the writes are no candidate


@pytest.mark.parametrize("activations", [0, (0, "x"), (-1,), (True,)])
def test_activations_must_be_a_tuple_of_argument_indices(activations):
    with pytest.raises(TypeError, match=r"activations for op 'x.y' must be a tuple of positional argument indices"):
        OpDefinition("x.y", shapes=[], make_inputs=lambda shape, device: (), activations=activations)


def test_graph_timing_gives_each_call_the_next_copy_of_the_ops_weights():
    # Replayed on one weight, a GEMM whose weight fits in the H200's L2 read it from there: triton's mm ran 0.77x
    # cuBLAS's time at 12 tokens of 4096 x 4096, 0.87x with the weight cycled past the L2 as a model step reads
    # it, and the two ranked 2816 x 5120 at 8-16 tokens oppositely (commit f981d83).
    from autosel.tuner import _after_writing

    base = (torch.zeros(4), torch.ones(1024), 2.0)  # an activation, a weight of 4 KB, a number
    seen = []
    call = _after_writing(lambda x, w, k: seen.append((x.data_ptr(), w.data_ptr(), k)), (0,), base, (1,), 3 * 4096)
    for _ in range(7):
        call()
    weights = [w for _, w, _ in seen]
    assert len({x for x, _, _ in seen}) == 1  # one activation buffer, written before every call
    assert len(set(weights)) == 3 and weights == weights[:3] * 2 + weights[:1]  # three copies, in turn
    assert base[1].data_ptr() not in weights and {k for _, _, k in seen} == {2.0}
    seen.clear()
    once = _after_writing(lambda x, w, k: seen.append(w.data_ptr()), (0,), base)  # no weights declared: one copy
    once(), once()
    assert len(set(seen)) == 1


def test_evidence_names_a_timing_that_read_the_weights_from_memory_and_keeps_its_rule(toy):
    from autosel.policy import GRAPH_RULE, rule_for

    _, kernels = toy

    class GraphLike(CpuTimer):  # CudaGraphTimer's method and attributes, on this CPU
        method = "cuda:graph-replay, activations written"
        writes_activations = True
        weight_bytes = 1 << 10

    candidates = [KernelSpec(OP, B(b), "toy_kernels:head_in_place") for b in ("torch", "triton")]
    methods = []
    for weights, activations in (((1,), (0,)), ((), (0,)), ((1,), ())):
        definition = OpDefinition(OP, shapes=[{"n": 1}], make_inputs=kernels.big_activation, weights=weights,
                                  activations=activations)
        decision = Tuner(timer=GraphLike(blocks=3), device="cpu").tune(
            definition, candidates, reference=kernels.head_in_place, shapes=[{"n": 1}], mode="graph",
            platform_key="cpu/test", versions={})
        methods.append(decision.method)
        assert rule_for(decision.method) is GRAPH_RULE  # the graph rule, not the 3% of an unknown method
    # An op that declares no activations (attention) had its evidence say they were written.
    assert methods == ["cuda:graph-replay, activations written, weights from memory",
                       "cuda:graph-replay, activations written", "cuda:graph-replay, weights from memory"]


@pytest.mark.parametrize("weights, error, said", [
    ((0, 1.5), TypeError, r"weights for op 'x.y' must be a tuple of positional argument indices, such as \(1,\)"),
    ((0,), ValueError, r"op 'x.y': argument\(s\) \[0\] are both activations .* and weights"),
])
def test_weights_must_be_argument_indices_other_than_the_activations(weights, error, said):
    with pytest.raises(error, match=said):
        OpDefinition("x.y", shapes=[], make_inputs=lambda shape, device: (), weights=weights)


def test_the_writes_are_taken_off_each_sample_of_their_block():
    from autosel.tuner import WRITES, _after_writing, _less_writes

    assert _less_writes({"a": [5.0, 7.0], WRITES: [2.0, 3.0], "b": [2.5, 2.9]}, {}, OP, {"n": 1}) == {
        "a": [3.0, 4.0], "b": [0.5, 1e-3]}  # at or below the writes': kept at 1 ns
    with pytest.raises(TuningError, match=r"op 'toy.double': writing its activations before each timed call "
                                          r"raised at n=1: out of memory"):
        _less_writes({"a": [5.0]}, {WRITES: RuntimeError("out of memory")}, OP, {"n": 1})
    base = (torch.zeros(4), torch.ones(4), 2.0)
    seen = []
    call = _after_writing(lambda x, y, k: seen.append(x.clone()) or x.add_(y * k), (0,), base)
    call(), call()
    assert [s.tolist() for s in seen] == [[0.0] * 4] * 2 and base[0].tolist() == [0.0] * 4  # its own copy
    writes_alone = _after_writing(None, (0, 5), base)  # an index past the arguments is passed over
    assert writes_alone() is None


def test_block_sampler_times_are_per_call_microseconds():
    import time

    sample = block_sampler(lambda: time.sleep(200e-6), block_us=2000)
    samples = [sample() for _ in range(5)]
    assert all(200 <= t < 20_000 for t in samples)  # a sleep of 200 us per call, never less


class SamplingFake(SamplingTimer):
    """A sampling timer (as the real ones are): each sampler returns its backend's time times the machine's
    slowness during that block (1x to 3x); records the order of the samples."""

    method = "fake"
    blocks = 5
    SLOWNESS = (1.0, 3.0, 2.0, 1.5, 2.5)  # per block

    def __init__(self, base_us: dict[str, float], broken: dict[str, str] | None = None):
        self.base_us, self.broken, self.order = base_us, broken or {}, []

    def sampler(self, fn):
        backend = fn()
        if self.broken.get(backend) == "at once":
            raise RuntimeError("no kernel image")

        def sample():
            self.order.append(backend)
            if self.broken.get(backend) == "later" and self.order.count(backend) == 3:
                raise RuntimeError("illegal memory access")
            block = (len(self.order) - 1) // len(self.base_us)
            return self.base_us[backend] * self.SLOWNESS[block % len(self.SLOWNESS)]

        return sample


def test_measure_together_takes_turns_block_by_block_and_takes_the_common_drift_out():
    timer = SamplingFake({"a": 10.0, "b": 20.0, "c": 40.0})
    times, failed = measure_together(timer, {b: (lambda b=b: b) for b in "abc"}, shape={})
    assert failed == {}
    assert "".join(timer.order) == "abc" + "bca" + "cab" + "abc" + "bca"  # each block in turn, rotating
    # The machine's slowness moved 1x-3x between blocks; what is left is each backend's own time.
    typical = statistics.median(SamplingFake.SLOWNESS)  # 2.0
    assert times == {b: pytest.approx([us * typical] * 5) for b, us in timer.base_us.items()}


def test_measure_together_isolates_a_candidate_that_raises():
    timer = SamplingFake({"a": 10.0, "b": 20.0, "c": 40.0}, broken={"b": "at once", "c": "later"})
    times, failed = measure_together(timer, {b: (lambda b=b: b) for b in "abc"}, shape={})
    assert set(failed) == {"b", "c"} and "no kernel image" in str(failed["b"])
    assert list(times) == ["a"] and len(times["a"]) == 5  # a went on to the end


def test_measure_together_a_call_that_exits_is_a_failed_candidate():
    # A kernel calling sys.exit while timed used to end the tuning process (SystemExit is no Exception).
    import sys

    times, failed = measure_together(CpuTimer(blocks=5), {"a": lambda: 1 + 1, "b": lambda: sys.exit(3)}, shape={})
    assert isinstance(failed["b"], SystemExit) and failed["b"].code == 3 and list(times) == ["a"]


def test_a_turn_of_slow_calls_stops_at_run_s_after_min_blocks():
    timer = SamplingFake({"a": 10.0, "b": 20.0})
    timer.blocks, timer.run_s = 50, 0.0  # every turn is over time
    times, _ = measure_together(timer, {b: (lambda b=b: b) for b in "ab"}, shape={})
    assert [len(t) for t in times.values()] == [timer.min_blocks] * 2
    timer.run_s = 60.0
    assert [len(t) for t in measure_together(timer, {"a": lambda: "a"}, shape={})[0].values()] == [50]


def test_common_drift_removed_makes_the_ratio_of_medians_the_median_of_paired_ratios():
    rng = random.Random(0)
    drift = [rng.uniform(1, 3) for _ in range(9)]  # the machine's speed, block by block
    a = [100 * d * rng.uniform(0.99, 1.01) for d in drift]
    b = [120 * d * rng.uniform(0.99, 1.01) for d in drift]
    paired = statistics.median(y / x for x, y in zip(a, b))
    ca, cb = common_drift_removed([a, b])
    assert statistics.median(cb) / statistics.median(ca) == pytest.approx(paired, rel=1e-9)
    assert statistics.median(b) / statistics.median(a) != pytest.approx(paired, rel=0.01)  # raw: drift left
    assert max(ca) / min(ca) < 1.05  # a 3x drift gone, 1% noise left
    assert common_drift_removed([a]) == [a]  # nothing to compare with: untouched


class RotatingTimer(FakeTimer):
    """Asks for input copies of three times the input's bytes, and calls the kernel six times per measurement."""

    rotate_bytes = 3 * 4 * (1 << 16)  # three float32 copies of the first shape's input

    def measure(self, fn, *, backend, shape):
        for _ in range(6):
            fn()
        return super().measure(fn, backend=backend, shape=shape)


def test_a_rotating_timer_gets_calls_on_distinct_input_copies(toy):
    definition, kernels = toy
    kernels.SEEN.clear()
    run(definition, kernels, specs(torch="fast", triton="records_inputs"), RotatingTimer({"torch": 1, "triton": 1}),
        rounds=1)
    # Six timed calls each, then the check after timing: one call per shape on fresh inputs.
    first_shape, second_shape = kernels.SEEN[-14:-8], kernels.SEEN[-8:-2]
    assert len(set(first_shape)) == 3 and first_shape[:3] == first_shape[3:]  # 3 copies, cycled twice
    assert len(set(second_shape)) == 6  # a quarter of the size: 12 copies, 6 of them used


def test_rotating_copies_cover_the_bytes_asked_for():
    import torch

    x = torch.zeros(1 << 18)  # 1 MiB
    copies = rotating_copies((x, 3), min_bytes=(4 << 20) + 1)
    assert len(copies) == 5 and all(c[1] == 3 for c in copies)
    assert len({c[0].data_ptr() for c in copies}) == 5 and x.data_ptr() not in {c[0].data_ptr() for c in copies}
    assert len(rotating_copies((x,), min_bytes=0)) == 1
    assert len(rotating_copies((x,), min_bytes=1 << 40, most=8)) == 8


def test_wrong_raising_and_nan_candidates_are_rejected_with_reasons(toy):
    definition, kernels = toy
    timer = FakeTimer({"torch": 100.0, "aot": 1.0, "jit": 1.0, "cute_dsl": 1.0})
    decision = run(definition, kernels, specs(torch="fast", aot="wrong_but_fast", jit="raises", cute_dsl="nan"),
                   timer)
    assert decision.winner == "torch"
    reasons = {c.backend: c.reason for c in decision.candidates if c.status == "rejected"}
    assert set(reasons) == {"aot", "jit", "cute_dsl"}
    assert "max abs error" in reasons["aot"] and "at n=65536" in reasons["aot"]
    assert reasons["jit"].startswith("raised RuntimeError: illegal memory access")
    assert "contains NaN" in reasons["cute_dsl"]
    assert decision.candidate("aot").shapes[0].max_abs_err > 0.1
    assert {b for b, _ in timer.calls} == {"torch"}  # rejected candidates are never timed


def test_a_candidate_whose_outputs_turn_nan_after_its_first_calls_is_rejected_after_timing(toy):
    # It passed the check before timing (its first calls), turned NaN while timed, and was stored with status ok.
    definition, kernels = toy
    kernels.nan_later_calls.clear()
    decision = run(definition, kernels, specs(torch="fast", triton="nan_after_its_first_calls"),
                   RotatingTimer({"torch": 100.0, "triton": 50.0}))  # it calls the kernels it times
    assert decision.winner == "torch"
    [rejected] = [c for c in decision.candidates if c.status == "rejected"]
    assert rejected.backend == "triton"
    assert rejected.reason.startswith("wrong after its timed calls: ") and "NaN" in rejected.reason


def test_a_candidate_that_writes_over_its_input_is_rejected(toy):
    # It passed: only the returned tensor was compared, and it could win while corrupting the caller's tensors.
    definition, kernels = toy
    decision = run(definition, kernels, specs(torch="fast", aot="doubles_in_place"), FakeTimer({"torch": 100.0}))
    assert decision.winner == "torch"
    assert decision.candidate("aot").reason == ("changed its input argument 0, which the reference leaves as it "
                                                "is, at n=65536")


def test_an_input_the_reference_writes_is_compared_with_its_values_not_required_unchanged(toy):
    # The first version of the input check required every input to equal the reference's bit for bit after the
    # call, so a candidate that skipped the reference's write was told it had changed an input it never touched.
    definition, kernels = toy
    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu")
    decision = tuner.tune(definition, specs(torch="doubles_and_counts_in_input", triton="fast"),
                          reference=kernels.doubles_and_counts_in_input, shapes=kernels.SHAPES, mode="eager",
                          platform_key="cpu/test", versions={})
    reason = decision.candidate("triton").reason
    assert reason.startswith("its input argument 0, which the reference writes, after the call: ") and "n=65536" in reason
    assert decision.winner == "torch"


def test_a_reference_or_bucket_function_that_raises_is_a_tuning_error_naming_the_op(toy):
    # Both ended in the bare exception, naming neither the op nor the shape, and `autosel tune` stopped there.
    definition, kernels = toy

    def broken(x):
        raise ZeroDivisionError("division by zero")

    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu")
    with pytest.raises(TuningError, match=r"^op 'toy.double': its reference raised ZeroDivisionError: division by "
                                          r"zero at n=65536; fix the reference"):
        tuner.tune(definition, specs(torch="fast", triton="fast"), reference=broken, shapes=kernels.SHAPES,
                   mode="eager", platform_key="cpu/test", versions={})
    bucketed = dataclasses.replace(definition, bucket=broken)
    with pytest.raises(TuningError, match=r"^op 'toy.double': its bucket function raised ZeroDivisionError"):
        tuner.tune_buckets(bucketed, specs(torch="fast", triton="fast"), reference=kernels.fast,
                           shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})


class UnhashableInt(int):
    def __hash__(self):
        raise RuntimeError("no hash")


@pytest.mark.parametrize("bucket, route_key, message", [
    # NaN != NaN: "2 buckets" were reported and one row stored, as [NaN], which is not JSON.
    (lambda x, w: (float("nan"),), None, r"its bucket function returned \(nan,\), which is no bucket key: it holds a "
                                         r"float that is not finite; it must return a tuple of ints, finite floats"),
    # Escaped select_kernel untranslated: a bucket function's sys.exit and GeneratorExit, and a key whose __hash__
    # raises (an int subclass passed the isinstance check).
    (lambda x, w: sys.exit(3), None, r"its bucket function raised SystemExit: 3"),
    (lambda x, w: (_ for _ in ()).throw(GeneratorExit("stop")), None, r"its bucket function raised GeneratorExit"),
    (lambda x, w: (UnhashableInt(4),), None, r"which is no bucket key: it holds UnhashableInt 4, which is not an int"),
    # A 5 MB string was stored as the key of every row of the tune (the DB grew to 15 MB).
    (lambda x, w: ("x" * 5_000_000,), None, r"it is 5000004 characters long as text, over 256"),
    # (True,) and (1,) are one dict key: one bucket's winner ran for the other's calls, and the DB held both.
    (lambda x, w: (x.numel() > 20000,) if x.numel() > 20000 else (1,), None,
     r"its bucket function returned \[true\] and \[1\], which Python takes for one bucket"),
    # The dispatcher looks calls up by the route argument's shape alone: calls went to another bucket's winner.
    (lambda x, w: (x.numel(),), 1, r"route_key=1 does not decide the bucket: two shapes whose argument 1 has the "
                                   r"shape \(\(3,\),\) fall in buckets"),
], ids=["nan", "sys-exit", "generator-exit", "hash-raises", "5-MB", "true-and-1", "wrong-route-key"])
def test_a_bucket_key_that_cannot_route_calls_is_a_tuning_error(toy, bucket, route_key, message):
    definition, kernels = toy
    bucketed = dataclasses.replace(definition, bucket=bucket, route_key=route_key,
                                   make_inputs=kernels.inputs_with_weight)
    with pytest.raises(TuningError, match=message):
        Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu").tune_buckets(
            bucketed, specs(torch="with_weight", triton="with_weight"), reference=kernels.with_weight,
            shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})


def test_make_inputs_returning_no_tuple_is_named_not_blamed_on_the_reference(toy):
    # A bare tensor was unpacked into its elements: "its reference raised TypeError: ... 16 were given".
    definition, kernels = toy
    bare = dataclasses.replace(definition, make_inputs=lambda shape, device: kernels.inputs(shape, device)[0])
    with pytest.raises(TuningError, match=r"^op 'toy.double': its make_inputs returned a Tensor for the shape "
                                          r"n=65536; it must return the positional arguments of one call as a tuple"):
        Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu").tune(
            bare, specs(torch="fast", triton="fast"), reference=kernels.fast, shapes=kernels.SHAPES, mode="eager",
            platform_key="cpu/test", versions={})


def test_an_in_place_op_is_judged_by_its_arguments_whatever_a_candidate_returns(toy):
    # x.add_(y) returns x: "returned 1 outputs, reference returned 2"; a candidate that wrote over its second input
    # was told its "output 1" differed, though the op has no outputs.
    definition, kernels = toy
    in_place = dataclasses.replace(definition, make_inputs=kernels.two_inputs)
    decision = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0, "jit": 10.0}), device="cpu").tune(
        in_place, specs(torch="add_in_place", triton="add_in_place_returning", jit="add_in_place_zeroing_y"),
        reference=kernels.add_in_place, shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})
    assert decision.winner == "triton"
    assert decision.candidate("jit").reason.startswith("argument 1 after the call differs from the reference")


def test_unloadable_candidate_is_rejected_not_raised(toy):
    definition, kernels = toy
    candidates = specs(torch="fast") + [KernelSpec(OP, B.TRITON, "no_such_module_xyz:fn")]
    decision = run(definition, kernels, candidates, FakeTimer({"torch": 1.0}))
    assert decision.winner == "torch"
    assert "could not load 'no_such_module_xyz:fn'" in decision.candidate("triton").reason


def test_no_correct_candidate_is_a_tuning_error_with_every_reason(toy):
    definition, kernels = toy
    with pytest.raises(TuningError, match=r"no candidate passed the checks \(aot: .*; jit: raised"):
        run(definition, kernels, specs(aot="wrong_but_fast", jit="raises"), FakeTimer({}))


def test_a_shape_missing_a_key_of_the_input_factory_is_a_tuning_error_naming_op_shape_and_key(toy):
    # `autosel tune --shapes` with a wrong key ended in a bare KeyError: 'n' traceback from the input factory.
    definition, kernels = toy
    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu")
    with pytest.raises(TuningError) as info:
        tuner.tune(definition, specs(torch="fast", triton="fast"), reference=kernels.fast, shapes=[{"tokens": 64}],
                   mode="eager", platform_key="cpu/test", versions={})
    assert str(info.value) == ("op 'toy.double': its make_inputs raised KeyError: 'n' for the shape tokens=64: "
                               "the shape has no key 'n', which the op's input factory reads; give each shape "
                               "the keys of the op's declared shapes")


def test_per_shape_winners_are_stored(toy):
    definition, kernels = toy
    n2 = kernels.SHAPES[1]["n"]
    timer = FakeTimer({"torch": 100.0, "triton": 80.0}, shape_factor={("triton", n2): 2.0})
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    assert [w for _, w in decision.per_shape_winners] == ["triton", "torch"]
    # op level: geomean of (0.8/0.8, 1.6/1.0) = 1.26 for triton vs (1.25, 1.0) = 1.12 for torch
    assert decision.winner == "torch"


def test_same_seed_same_decision(toy):
    definition, kernels = toy
    decisions = [run(definition, kernels, specs(torch="fast", triton="fast"),
                     FakeTimer({"torch": 100.0, "triton": 97.0}, noise=0.05, seed=7)) for _ in range(2)]
    assert decisions[0].winner == decisions[1].winner
    timings = [[(c.score, [s.timing for s in c.shapes]) for c in d.candidates] for d in decisions]
    assert timings[0] == timings[1]


@pytest.mark.parametrize("readings, margin, expected", [
    ({"a": [1.0], "b": [0.9], "c": [0.88]}, 0.03, "b"),   # c is inside b's margin: registration order keeps b
    ({"a": [1.0], "b": [0.99], "c": [0.5]}, 0.03, "c"),
    ({"a": [1.0], "b": [1.02]}, 0.03, "a"),
    ({"a": [1.0, 1.0, 1.0], "b": [0.8, 0.8, 0.99]}, 0.03, "a"),  # b lost one reading: no win
    ({"a": [1.0, 1.2, 1.0], "b": [0.8, 0.8, 0.9]}, 0.03, "b"),
    ({"a": [1.0, 1.0, 1.0], "b": [0.8, 0.8, 0.99], "may_lose": 1}, 0.03, "b"),  # one round of three may be lost
    ({"a": [1.0, 1.0, 1.0], "b": [0.8, 0.99, 0.99], "may_lose": 1}, 0.03, "a"),
    ({"a": [1.0], "b": [0.99], "may_lose": 1}, 0.03, "a"),  # never fewer than one win
    # Walking pairwise would take c: it beats a, which b (level with c) just failed to. The earliest
    # candidate level with the fastest is b, whichever of b and c the noise made fastest.
    ({"a": [1.70], "b": [1.63], "c": [1.60]}, 0.05, "b"),
    ({"a": [1.70], "b": [1.60], "c": [1.63]}, 0.05, "b"),
])
def test_choose_takes_the_earliest_candidate_level_with_the_fastest(readings, margin, expected):
    may_lose = readings.pop("may_lose", 0)
    assert choose(list(readings), readings, margin, may_lose) == expected


def _m(median, rounds=(), host=None, device=None, method="stored"):
    from autosel.decisions import Measurement

    return Measurement(median_us=median, p20_us=median, p80_us=median, samples=30, method=method,
                       round_medians_us=tuple(rounds), host_us=host, device_us=device)


def test_on_cpu_a_win_may_lose_one_round_of_three():
    # torch_compile's rmsnorm at 128 x 4096 on the 2-core CPU: 127, 228 and 124 us against torch's 209-210.
    stats = {"torch": [_m(209.9, (208.9, 209.9, 210.0), method="cpu:torch.utils.benchmark")],
             "torch_compile": [_m(127.3, (127.3, 228.0, 123.5), method="cpu:torch.utils.benchmark")]}
    assert judge(stats).shape_winners == ["torch_compile"]
    stats = {b: [dataclasses.replace(ms[0], method="cuda:graph-replay")] for b, ms in stats.items()}
    assert judge(stats).shape_winners == ["torch"]  # graph replay rounds are steady: every round counts


def test_graph_replay_does_not_count_the_lead_vendor_kernels_under_2_us_have_over_triton():
    # rmsnorm at 1 x 4096 in graph mode on the H200 (call N, tune 2): flashinfer 5.0-7.6% ahead of triton per
    # round, about 0.09 us. Two tunes put that pair on both sides of a 5% floor; under the 6% one triton keeps it.
    stats = {"triton": [_m(1.68, (1.69, 1.67, 1.70), method="cuda:graph-replay")],
             "flashinfer": [_m(1.58, (1.57, 1.59, 1.58), method="cuda:graph-replay")]}
    assert judge(stats).shape_winners == ["triton"]
    assert judge(stats, margin_floor=0.05).shape_winners == ["flashinfer"]


def test_a_win_must_hold_in_every_round():
    # b is 12% faster by the pooled median, but one round of three had it level: the default keeps it.
    stats = {"a": [_m(100.0, (100.0, 100.0, 100.0))], "b": [_m(88.0, (88.0, 87.0, 99.0))]}
    assert judge(stats, margin_floor=0.05).shape_winners == ["a"]
    stats["b"] = [_m(88.0, (88.0, 87.0, 90.0))]
    assert judge(stats, margin_floor=0.05).shape_winners == ["b"]


def test_a_measurement_of_fewer_rounds_keeps_its_ratio_to_the_shape_s_fastest_in_the_rounds_it_sat_out():
    # b sat out rounds two and three at the second shape (settled: 2x behind a after the first round).
    stats = {"a": [_m(100.0, (100.0, 100.0, 90.0)), _m(50.0, (50.0, 50.0, 50.0))],
             "b": [_m(88.0, (88.0, 87.0, 89.0)), _m(100.0, (100.0,))]}
    verdict = judge(stats, margin_floor=0.05)
    assert verdict.shape_winners == ["a", "a"]  # at the first shape b is level with a in the third round
    stats["a"][0] = _m(100.0, (100.0, 100.0, 100.0))
    assert judge(stats, margin_floor=0.05).shape_winners == ["b", "a"]
    # H200, gelu_and_mul eager at 1 x 28672 (commit 8c78c9d): triton, settled after 20.3 us against flashinfer's 12.0,
    # then a round in which the host slowed every launch-bound call 1.7x. Read as 20.3 us there, triton was not
    # beaten in that round and, registered first, kept the shape; carried at its ratio it is.
    stats = {"triton": [_m(20.3, (20.3,), method="cuda:back-to-back")],
             "flashinfer": [_m(12.9, (12.0, 20.6, 12.9), method="cuda:back-to-back")]}
    assert judge(stats).shape_winners == ["flashinfer"]


def test_a_win_that_depends_on_the_host_speed_does_not_count():
    from autosel.policy import HOST_SLOWER, at_host_speed

    # a: device-bound (host 10 us, device 40 us); b: launch-bound (host 30, device 5). b wins at this host's
    # speed (30 vs 40 us) but loses once the host runs HOST_SLOWER times slower (48 vs 40 us).
    a, b = _m(40.0, host=10.0, device=40.0), _m(30.0, host=30.0, device=5.0)
    assert at_host_speed(b, HOST_SLOWER) == pytest.approx(30.0 * HOST_SLOWER)
    assert at_host_speed(a, HOST_SLOWER) == 40.0  # device-bound: the host's speed does not move it
    assert judge({"a": [a], "b": [b]}, margin_floor=0.05).shape_winners == ["a"]
    # Two launch-bound candidates move together, so a 2x lead holds at any host speed.
    c = _m(15.0, host=15.0, device=5.0)
    assert judge({"b": [b], "c": [c]}, margin_floor=0.05).shape_winners == ["c"]
    # Without the two parts (CPU, graph replay) only the measured time counts.
    assert judge({"a": [_m(40.0)], "b": [_m(30.0)]}, margin_floor=0.05).shape_winners == ["b"]


def test_a_host_in_its_fast_or_its_slow_state_gives_the_same_decision():
    # rope at 2048 tokens on the H200 (call O): the host ran in a fast state in tune 1 and 1.6x slower in tune 2.
    # flashinfer was 1.5-1.6x faster in both; asking about a host 1.6x faster than the fast state (never seen)
    # made triton level there, and kept it in tune 1 only.
    method = "cuda:back-to-back"
    fast = {"triton": [_m(21.4, (20.8, 22.0, 21.4), host=21.8, device=8.7, method=method)],
            "flashinfer": [_m(14.4, (13.9, 14.8, 14.5), host=14.7, device=13.0, method=method)]}
    slow = {"triton": [_m(37.7, (38.4, 38.4, 36.4), host=36.8, device=8.6, method=method)],
            "flashinfer": [_m(23.3, (23.5, 23.5, 22.9), host=24.2, device=13.0, method=method)]}
    assert judge(fast).shape_winners == judge(slow).shape_winners == ["flashinfer"]


def test_eager_ties_go_past_a_candidate_whose_launch_is_heavy_and_graph_ties_by_registration_order():
    # H200 eager rmsnorm over the representative shapes after Triton's launches went to C (commit 2495846): triton 31.6
    # us, flashinfer 31.4, level; registered first, triton took the op, then ran held-out launch-bound shapes at
    # 1.25x the per-shape best: its host part was twice flashinfer's. In eager mode such a tie goes to the lighter
    # launch; in graph mode registration order holds.
    def stats(method, triton_host=10.5):
        host = method == "cuda:back-to-back"
        return {"torch": [_m(300.0, method=method, host=40.0 if host else None, device=300.0 if host else None)],
                "triton": [_m(31.6, (31.5, 31.7, 31.6), method=method,
                              host=triton_host if host else None, device=31.0 if host else None)],
                "flashinfer": [_m(31.4, (31.3, 31.5, 31.4), method=method,
                                  host=5.5 if host else None, device=31.0 if host else None)]}

    assert judge(stats("cuda:back-to-back")).winner == "flashinfer"
    assert judge(stats("cuda:graph-replay")).winner == "triton"
    # The norms' Triton launch from C (commit 74efafc): level with flashinfer's on the host, so registration order.
    assert judge(stats("cuda:back-to-back", triton_host=5.6)).winner == "triton"
    eager = stats("cuda:back-to-back")
    eager["triton"] = [_m(25.0, (25.0, 25.1, 24.9), method="cuda:back-to-back", host=10.5, device=25.0)]
    assert judge(eager).winner == "triton"  # last in the order, it still wins by beating the others


def test_a_heavy_host_is_measured_against_the_lightest_candidate_in_the_tie():
    from autosel.policy import heavy_hosts

    hosts = {"a": 5.2, "b": 8.1, "c": 7.5}
    assert heavy_hosts(["a", "b", "c"], hosts, 1.5) == {"b"}  # 8.1 against a's 5.2; c's 7.5 is within 1.5x
    assert heavy_hosts(["b", "c"], hosts, 1.5) == set()  # a not in the tie: b and c are within 1.5x of each other
    assert heavy_hosts(["a", "b", "c"], hosts, None) == set()
    assert heavy_hosts(["a", "b", "c"], {**hosts, "a": None}, 1.5) == set()  # a host part not measured: no step


def test_a_candidate_outside_the_tie_does_not_move_it():
    # A review's case: a and b level, b's launch 1.3x lighter, so b wins the tie; a third backend 1.5x slower (so
    # not in the tie) with a lighter launch still made both heavy, and a, registered first, won.
    method = "cuda:back-to-back"
    a = [_m(20.0, (20.0, 20.1, 19.9), method=method, host=6.5, device=19.0)]
    b = [_m(20.0, (20.0, 19.9, 20.1), method=method, host=5.0, device=19.0)]
    c = [_m(30.0, (30.0, 30.1, 29.9), method=method, host=4.0, device=29.0)]
    assert judge({"a": a, "b": b}).winner == "b"
    assert judge({"a": a, "b": b, "c": c}).winner == "b"
    assert judge({"a": a, "b": b, "c": c}).shape_winners == ["b"]


def test_a_bucket_default_is_never_passed_over_and_partial_host_parts_take_no_step():
    from autosel.policy import DEFAULT_POLICY

    method = "cuda:back-to-back"
    heavy = [_m(20.0, (20.0, 20.1, 19.9), method=method, host=9.0, device=19.0)]
    light = [_m(20.0, (20.0, 19.9, 20.1), method=method, host=5.0, device=19.0)]
    assert DEFAULT_POLICY.judge({"a": heavy, "b": light}).winner == "b"
    assert DEFAULT_POLICY.judge({"a": heavy, "b": light}, default="a").winner == "a"
    assert DEFAULT_POLICY.judge({"b": light, "a": heavy}, default="a").winner == "a"
    unmeasured = [_m(20.0, (20.0, 20.1, 19.9), method=method)]
    assert DEFAULT_POLICY.judge({"a": unmeasured, "b": light}).winner == "a"  # registration order, as before


def test_eager_ties_pass_over_a_launch_through_python_and_keep_one_1_14x():
    # H200 (commit fa1f314): the Triton norm launched through Python cost the host 9.9-11.1 us against flashinfer's
    # 5.4-5.8, and a tie made a 1.9x loss at launch-bound shapes: passed over. Commit c917452, eager fused add +
    # rmsnorm, op level:
    # triton (from C) 6.29 against flashinfer's 5.53 us in tune 1, 7.58 against 7.95 in tune 2; at a cut of 1.13 the
    # op and its 13 buckets changed hands between the tunes. Both tunes now keep triton, registered first.
    method = "cuda:back-to-back"
    through_python = {"triton": [_m(27.8, (27.8, 27.9, 27.7), method=method, host=10.5, device=27.0)],
                      "flashinfer": [_m(27.4, (27.4, 27.5, 27.3), method=method, host=5.6, device=27.0)]}
    assert judge(through_python).winner == "flashinfer"
    for triton_host, flashinfer_host in ((6.29, 5.53), (7.58, 7.95)):
        fused = {"triton": [_m(27.8, (27.8, 27.9, 27.7), method=method, host=triton_host, device=27.0)],
                 "flashinfer": [_m(27.4, (27.4, 27.5, 27.3), method=method, host=flashinfer_host, device=27.0)]}
        assert judge(fused).winner == "triton"


def test_a_bucket_keeps_the_op_level_winner_on_a_tie_even_where_the_rule_puts_it_last():
    from autosel.policy import DEFAULT_POLICY

    method = "cuda:back-to-back"
    stats = {"triton": [_m(20.0, (20.0, 20.1, 19.9), method=method, host=10.0, device=20.0)],
             "flashinfer": [_m(19.8, (19.8, 19.7, 19.9), method=method, host=5.0, device=19.8)]}
    verdicts = DEFAULT_POLICY.judge_groups(stats, {"bucket": [0]}, default="triton")
    assert verdicts["bucket"].winner == "triton"
    assert DEFAULT_POLICY.judge(stats).winner == "flashinfer"  # without a default the heavy launch goes last


@pytest.mark.parametrize("faster", ["triton", "flashinfer"])
def test_a_bucket_without_a_default_goes_to_its_fastest_through_a_tie(faster):
    from autosel.policy import DEFAULT_POLICY

    # A planned op's graph buckets (autosel.tuner): a 1% lead, inside the 6% floor, once kept the op-level winner.
    method = "cuda:graph-replay, weights from memory"
    times = {faster: 19.8, ({"triton", "flashinfer"} - {faster}).pop(): 20.0}
    stats = {b: [_m(times[b], (times[b], times[b] + 0.1, times[b] - 0.1), method=method)]
             for b in ("flashinfer", "triton")}
    assert DEFAULT_POLICY.judge_groups(stats, {"bucket": [0]}, default=None)["bucket"].winner == faster
    assert DEFAULT_POLICY.judge_groups(stats, {"bucket": [0]}, default="flashinfer")["bucket"].winner == "flashinfer"


def test_the_floor_follows_the_timing_method():
    from autosel.policy import RULES

    for method, floor in ((m, r.floor) for m, r in RULES.items()):
        stats = {"a": [_m(100.0, method=method)], "b": [_m(100.0 / (1 + floor) - 0.5, method=method)]}
        assert judge(stats).margin == floor and judge(stats).winner == "b"
        stats["b"] = [_m(100.0 / (1 + floor) + 0.5, method=method)]
        assert judge(stats).winner == "a"


def test_real_cpu_timer_tells_a_64x_slower_kernel_apart(toy):
    definition, kernels = toy
    decision = run(definition, kernels, specs(torch="slow", triton="fast"), CpuTimer(blocks=10),
                   rounds=2)
    assert decision.winner == "triton"
    fast = decision.candidate("triton").shapes[0].timing
    assert fast.samples >= 1 and fast.p20_us <= fast.median_us <= fast.p80_us
    assert decision.method == "cpu:torch.utils.benchmark"


def test_isolation_records_crashes_and_hangs_and_the_others_go_on(toy):
    definition, kernels = toy
    candidates = specs(torch="fast", aot="segfaults", jit="hangs", triton="fast")
    decision = run(definition, kernels, candidates, FakeTimer({"torch": 100.0, "triton": 50.0}),
                   isolate_timeout_s=12)
    assert decision.winner == "triton"
    assert decision.candidate("aot").reason == "in isolation: crashed the process (SIGSEGV)"
    assert decision.candidate("jit").reason == "in isolation: hung: no answer from its check within 12 s (killed)"


def test_a_reference_that_raises_in_isolation_is_the_op_s_error_not_every_candidate_s(toy):
    # In the child it ended the check with a traceback: every candidate was rejected "in isolation: exited ...",
    # and the tune failed blaming the candidates.
    definition, kernels = toy
    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu", isolate_timeout_s=30)
    with pytest.raises(TuningError, match=r"^op 'toy.double': its reference raised RuntimeError: illegal memory "
                                          r"access \(simulated\) at n="):
        tuner.tune(definition, specs(torch="fast", triton="fast"), reference=kernels.raises, shapes=kernels.SHAPES,
                   mode="eager", platform_key="cpu/test", versions={})


def test_a_reference_that_crashes_in_isolation_is_the_op_s_error_not_every_candidate_s(toy):
    # The child died in the reference, and every candidate was rejected "in isolation: crashed the process".
    definition, kernels = toy
    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu", isolate_timeout_s=30)
    with pytest.raises(TuningError, match=r"^op 'toy.double': its reference \(toy_kernels:segfaults\) crashed the "
                                          r"process \(SIGSEGV\) in the isolated check's process, before any "
                                          r"candidate ran; fix the reference$"):
        tuner.tune(definition, specs(torch="fast", triton="fast"), reference=kernels.segfaults,
                   shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})


def test_isolation_turns_any_end_of_the_child_into_a_reason(toy):
    # Each of these used to crash the tune: exit status 0 (IndexError reading the answer), a kernel's stdout
    # without a newline (JSONDecodeError), and a segfault from the 4th call (in the parent's timing).
    definition, kernels = toy
    candidates = specs(torch="fast", aot="exits", jit="exits_hard", cute_dsl="chatty",
                       flashinfer="segfaults_from_the_4th_call", triton="fast")
    decision = run(definition, kernels, candidates, FakeTimer({"torch": 100.0, "cute_dsl": 100.0, "triton": 50.0}),
                   isolate_timeout_s=60)
    assert decision.winner == "triton"
    reasons = {c.backend: c.reason for c in decision.candidates}
    assert reasons["aot"] == "in isolation: raised SystemExit: 0 at n=65536"
    assert reasons["jit"] == "in isolation: ended the process (exit status 0) before its check finished: no message"
    assert reasons["cute_dsl"] is None and decision.candidate("cute_dsl").ok
    assert reasons["flashinfer"] == "in isolation: crashed the process (SIGSEGV)"


def test_isolation_timeout_times_the_candidate_not_the_child_s_start(toy):
    # With a 1 s timeout even the reference was reported "hung": the child's start (torch's import) counted.
    definition, kernels = toy
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), FakeTimer({"torch": 100.0, "triton": 50.0}),
                   isolate_timeout_s=1)
    assert [c.reason for c in decision.candidates] == [None, None] and decision.winner == "triton"


def test_isolation_that_cannot_start_says_so_instead_of_blaming_the_kernel(toy, monkeypatch):
    definition, kernels = toy
    monkeypatch.setenv("TOY_KERNELS_FAIL_IMPORT", "1")  # the child cannot import the op's make_inputs
    with pytest.raises(TuningError) as info:
        run(definition, kernels, specs(torch="fast", triton="fast"), FakeTimer({}), isolate_timeout_s=30)
    assert ("triton: in isolation: its isolated check could not start (crashed the process (exit status 1: "
            "ImportError: toy_kernels refuses to load in this process))") in str(info.value)


def test_a_candidate_that_calls_sys_exit_is_rejected_without_isolation(toy):
    # A candidate calling sys.exit used to end the caller's process silently.
    definition, kernels = toy
    decision = run(definition, kernels, specs(torch="fast", aot="exits"), FakeTimer({"torch": 100.0}))
    assert decision.winner == "torch"
    assert decision.candidate("aot").reason == "raised SystemExit: 0 at n=65536"


def test_the_isolated_child_sees_only_the_gpu_that_is_current_here(monkeypatch):
    # Used to break: `tune --devices 1,0` tunes GPU 1 in the parent, and a --isolate child checked on GPU 0.
    import torch

    from autosel.isolate import child_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert child_env("cuda")["CUDA_VISIBLE_DEVICES"] == "5"
    assert child_env("cpu")["CUDA_VISIBLE_DEVICES"] == "4,5,6"  # not a GPU tune: left as it is
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert child_env("cuda")["CUDA_VISIBLE_DEVICES"] == "1"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no GPU in use here yet: nothing to pin
    assert "CUDA_VISIBLE_DEVICES" not in child_env("cuda")


def test_isolation_needs_importable_input_factories(toy):
    definition, kernels = toy
    local = OpDefinition(OP, shapes=kernels.SHAPES, make_inputs=lambda shape, device: kernels.inputs(shape, device))
    with pytest.raises(TuningError, match="its make_inputs is not an importable module-level function"):
        run(local, kernels, specs(torch="fast", triton="fast"), FakeTimer({}), isolate_timeout_s=5)


def test_the_leader_is_never_dropped_even_when_every_score_is_far_from_one(toy):
    # Used to drop both: each was 10x behind on one shape, so both geometric means exceeded 3.
    definition, kernels = toy
    n1, n2 = kernels.SHAPES[0]["n"], kernels.SHAPES[1]["n"]
    timer = FakeTimer({"torch": 100.0, "triton": 100.0}, noise=0.0001,
                      shape_factor={("torch", n1): 10.0, ("triton", n2): 12.0})
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    assert decision.candidate("torch").status == "ok"


def test_a_candidate_far_behind_at_a_shape_after_the_first_round_is_not_timed_there_again(toy):
    definition, kernels = toy
    n1, n2 = kernels.SHAPES[0]["n"], kernels.SHAPES[1]["n"]
    # triton is 2x behind at n1 (past the 1.3x settled factor) and 20% ahead elsewhere.
    timer = FakeTimer({"torch": 100.0, "triton": 80.0}, noise=0.001, shape_factor={("triton", n1): 2.5})
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    assert timer.calls.count(("triton", n1)) == 1 and timer.calls.count(("triton", n2)) == 3
    # Alone at n1 after the first round, torch is not timed there again either: nothing is left to compare.
    assert timer.calls.count(("torch", n1)) == 1 and timer.calls.count(("torch", n2)) == 3
    assert len(decision.candidate("triton").shapes[0].timing.round_medians_us) == 1
    assert dict(decision.per_shape_winners)[_shape_json(kernels.SHAPES[0])] == "torch"
    assert dict(decision.per_shape_winners)[_shape_json(kernels.SHAPES[1])] == "triton"
    # Within the factor, every pair is timed in every round.
    close = FakeTimer({"torch": 100.0, "triton": 80.0}, noise=0.001, shape_factor={("triton", n1): 1.6})
    run(definition, kernels, specs(torch="fast", triton="fast"), close)
    assert close.calls.count(("triton", n1)) == 3


def _shape_json(shape: dict) -> str:
    import json

    return json.dumps(shape, sort_keys=True)


class DriftingTimer(FakeTimer):
    """triton is 10% faster, except in the second round, when the machine slows it by 1.67x."""

    def measure(self, fn, *, backend, shape):
        times = super().measure(fn, backend=backend, shape=shape)
        round_index = sum(1 for b, n in self.calls if (b, n) == (backend, shape["n"])) - 1
        return [t * 1.67 for t in times] if backend == "triton" and round_index == 1 else times


def test_drift_is_evidence_and_a_round_it_spoils_keeps_the_default(toy):
    definition, kernels = toy
    timer = DriftingTimer({"torch": 100.0, "triton": 90.0}, noise=0.001)
    decision = run(definition, kernels, specs(torch="fast", triton="fast"), timer)
    timing = decision.candidate("triton").shapes[0].timing
    assert len(timing.round_medians_us) == 3 and timing.drift == pytest.approx(0.335, abs=0.01)
    assert decision.margin == pytest.approx(0.03)  # docs/TUNING.md section 4 says why drift stays out
    # The pooled median (90 us) says triton, but it lost the second round: a win must hold in every round.
    assert decision.candidate("triton").score < decision.candidate("torch").score
    assert decision.winner == "torch"
    steady = run(definition, kernels, specs(torch="fast", triton="fast"),
                 FakeTimer({"torch": 100.0, "triton": 90.0}, noise=0.001))
    assert steady.winner == "triton"


class SplittingTimer(FakeTimer):
    """Also splits each call into host and device parts, as the eager CUDA timer does."""

    def __init__(self, base_us, parts: dict[str, tuple[float, float]], **kwargs):
        super().__init__(base_us, **kwargs)
        self.parts, self.backend_of = parts, {}

    def measure(self, fn, *, backend, shape):
        self.backend_of[fn] = backend
        return super().measure(fn, backend=backend, shape=shape)

    def host_and_device_us(self, fn):
        fn()
        return self.parts[self.backend_of[fn]]


def test_the_tuner_stores_host_and_device_parts_and_judges_with_them(toy):
    definition, kernels = toy
    # triton is 25% faster as measured, but launch-bound: at a host 1.6x slower it would lose to torch.
    parts = {"torch": (10.0, 40.0), "triton": (30.0, 5.0)}
    decision = run(definition, kernels, specs(torch="fast", triton="fast"),
                   SplittingTimer({"torch": 40.0, "triton": 30.0}, parts, noise=0.001))
    timing = decision.candidate("triton").shapes[0].timing
    assert (timing.host_us, timing.device_us) == (30.0, 5.0)
    assert decision.winner == "torch" and decision.per_shape_winners[0][1] == "torch"
    parts["triton"] = (20.0, 5.0)  # now it wins at any host speed in the range (32 vs 40 us at the slowest)
    decision = run(definition, kernels, specs(torch="fast", triton="fast"),
                   SplittingTimer({"torch": 40.0, "triton": 20.0}, parts, noise=0.001))
    assert decision.winner == "triton"


def test_without_the_sleep_kernel_the_eager_timer_offers_no_split(monkeypatch, caplog):
    import torch

    from autosel.timing import CudaEagerTimer

    assert callable(CudaEagerTimer().host_and_device_us)
    monkeypatch.delattr(torch.cuda, "_sleep")
    timer = CudaEagerTimer()
    assert timer.host_and_device_us is None  # the tuner then stores no parts, and judges on eager times alone
    assert "torch.cuda._sleep is missing" in caplog.text


# --- per-bucket decisions -----------------------------------------------------------------------------------

def bucketed(toy_kernels):
    return OpDefinition(OP, shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs, bucket=toy_kernels.bucket)


def test_each_bucket_gets_its_own_decision_from_the_same_measurements(toy):
    _, kernels = toy
    n1, n2 = kernels.SHAPES[0]["n"], kernels.SHAPES[1]["n"]
    # torch is 2x faster on the first shape, triton 3x faster on the second.
    timer = FakeTimer({"torch": 100.0, "triton": 100.0}, noise=0.001,
                      shape_factor={("triton", n1): 2.0, ("torch", n2): 3.0})
    tuner = Tuner(timer=timer, device="cpu")
    decision, buckets = tuner.tune_buckets(bucketed(kernels), specs(torch="fast", triton="fast"),
                                           reference=kernels.fast, shapes=kernels.SHAPES, mode="eager",
                                           platform_key="cpu/test", versions={"torch": "x"})
    # No timing beyond the op-level tune's: one round, after which each shape's loser, 2-3x behind, is settled.
    assert len(timer.calls) == 2 * 2
    assert decision.bucket == "*" and decision.winner == "triton"  # geomean: triton sqrt(2 x 1) < torch sqrt(1 x 3)
    assert [(b.bucket, b.winner) for b in buckets] == [(f"[{n1}]", "torch"), (f"[{n2}]", "triton")]
    first = buckets[0]
    assert [s.shape for s in first.candidate("torch").shapes] == [{"n": n1}]  # evidence of its own shapes only
    assert first.runner_up == "triton" and first.lead_over_runner_up == pytest.approx(1.0, rel=0.01)
    assert first.per_shape_winners == ((f'{{"n": {n1}}}', "torch"),)


@pytest.mark.parametrize("shapes, count", [(1, "1 bucket (0 with another winner)"),
                                           (2, "2 buckets (1 with another winner)")])
def test_the_chosen_event_counts_the_buckets_in_words(toy, shapes, count):
    # "1 buckets (0 with another winner)" on the tune's stderr.
    _, kernels = toy
    events = []
    timer = FakeTimer({"torch": 100.0, "triton": 100.0}, noise=0.001,
                      shape_factor={("triton", kernels.SHAPES[0]["n"]): 2.0, ("torch", kernels.SHAPES[1]["n"]): 3.0})
    Tuner(timer=timer, device="cpu", on_event=events.append).tune_buckets(
        bucketed(kernels), specs(torch="fast", triton="fast"), reference=kernels.fast,
        shapes=kernels.SHAPES[-shapes:], mode="eager", platform_key="cpu/test", versions={})
    assert events[-1].kind == "chosen" and events[-1].detail.endswith(f", {count}")


@pytest.mark.parametrize("triton_factor, expected", [
    (2.04, ["triton", "triton"]),  # torch 2% faster on the first shape: inside the 3% floor, triton kept there
    (2.2, ["torch", "triton"]),    # torch 9% faster: beyond the floor in every round
])
def test_a_bucket_is_decided_by_the_same_margin_rule(toy, triton_factor, expected):
    _, kernels = toy
    n1 = kernels.SHAPES[0]["n"]
    # triton, the op-level winner, is 2x faster on the second shape.
    timer = FakeTimer({"torch": 100.0, "triton": 50.0}, noise=0.001, shape_factor={("triton", n1): triton_factor})
    decision, buckets = Tuner(timer=timer, device="cpu").tune_buckets(
        bucketed(kernels), specs(torch="fast", triton="fast"), reference=kernels.fast, shapes=kernels.SHAPES,
        mode="eager", platform_key="cpu/test", versions={})
    assert decision.winner == "triton" and [b.winner for b in buckets] == expected


def test_a_candidate_far_behind_overall_but_fastest_at_one_shape_is_kept(toy):
    # Used to be dropped after round 1 (4x behind in geomean), though it would win its own bucket.
    _, kernels = toy
    n1, n2 = kernels.SHAPES[0]["n"], kernels.SHAPES[1]["n"]
    timer = FakeTimer({"torch": 100.0, "triton": 100.0}, noise=0.001,
                      shape_factor={("torch", n1): 0.9, ("torch", n2): 50.0})
    _, buckets = Tuner(timer=timer, device="cpu").tune_buckets(
        bucketed(kernels), specs(torch="fast", triton="fast"), reference=kernels.fast, shapes=kernels.SHAPES,
        mode="eager", platform_key="cpu/test", versions={})
    assert [b.winner for b in buckets] == ["torch", "triton"]
    assert buckets[0].candidate("torch").status == "ok"


def test_a_bucket_function_must_return_a_tuple(toy):
    _, kernels = toy
    definition = OpDefinition(OP, shapes=kernels.SHAPES, make_inputs=kernels.inputs, bucket=lambda x: x.numel())
    with pytest.raises(TuningError, match="must return a tuple"):
        Tuner(timer=FakeTimer({"torch": 1.0, "triton": 1.0}), device="cpu").tune_buckets(
            definition, specs(torch="fast", triton="fast"), reference=kernels.fast, shapes=kernels.SHAPES,
            mode="eager", platform_key="cpu/test", versions={})


def test_a_policy_is_a_value_the_tuner_is_given(toy):
    from autosel.policy import DEFAULT_POLICY, Policy

    _, kernels = toy
    timer = FakeTimer({"torch": 100.0, "triton": 90.0}, noise=0.001)  # 10% faster
    strict = dataclasses.replace(DEFAULT_POLICY, margin_floor=0.2)
    assert run(*toy, specs(torch="fast", triton="fast"), timer, policy=strict).winner == "torch"
    assert run(*toy, specs(torch="fast", triton="fast"), timer, policy=Policy()).winner == "triton"
    assert DEFAULT_POLICY.with_floor("cuda:graph-replay", 0.05).rule_for("cuda:do_bench_cudagraph").floor == 0.05
    with pytest.raises(ValueError, match="no timing method 'cuda:nope'"):
        DEFAULT_POLICY.with_floor("cuda:nope", 0.05)


def test_a_buckets_default_is_the_op_level_winner_not_the_first_registered(toy):
    # Used to break: a near-tie at one shape went to the earlier-registered backend (triton before flashinfer),
    # whose bucket then ran 1.8x slower on the shapes routed to it (H200, eager rmsnorm).
    _, kernels = toy
    n2 = kernels.SHAPES[1]["n"]
    # "triton" (registered first) is 2% slower than "jit" on the first shape and 2x slower on the second.
    timer = FakeTimer({"triton": 100.0, "jit": 98.0}, noise=0.001, shape_factor={("triton", n2): 2.0})
    decision, buckets = Tuner(timer=timer, device="cpu").tune_buckets(
        bucketed(kernels), specs(triton="fast", jit="fast"), reference=kernels.fast, shapes=kernels.SHAPES,
        mode="eager", platform_key="cpu/test", versions={})
    assert decision.winner == "jit"
    assert [b.winner for b in buckets] == ["jit", "jit"]  # the 2% near-tie keeps the op-level winner


def _plant(monkeypatch, kernels, **fns):
    """Kernels for one test, loadable as "toy_kernels:<name>"."""
    for name, fn in fns.items():
        monkeypatch.setattr(kernels, name, fn, raising=False)


def test_outputs_that_are_none_or_ints_are_compared_by_equality(toy, monkeypatch):
    # Used to break: with a reference returning (x * 2, None) every candidate, the reference's own backend too, was
    # rejected ("output 1 is NoneType, not a tensor"), and a tensor where it returns None raised AttributeError.
    definition, kernels = toy
    _plant(monkeypatch, kernels, pair_ref=lambda x: (x * 2, None, x.numel()),
           pair_same=lambda x: (x + x, None, x.numel()), pair_tensor=lambda x: (x * 2, x, x.numel()),
           pair_count=lambda x: (x * 2, None, x.numel() + 1))
    decision = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0, "jit": 10.0, "aot": 10.0}), device="cpu").tune(
        definition, specs(torch="pair_ref", triton="pair_same", jit="pair_tensor", aot="pair_count"),
        reference=kernels.pair_ref, shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})
    assert decision.winner == "triton"
    assert decision.candidate("jit").reason == ("output 1 is a torch.float32 [65536] tensor, reference is None "
                                                "at n=65536")
    assert decision.candidate("aot").reason == "output 2 is 65537, reference is 65536 at n=65536"


def test_an_in_place_candidate_returning_none_is_judged_by_its_arguments_when_the_reference_returns_one(toy):
    # Used to break: a reference x.add_(y) returns x, a correct candidate returning None was rejected with
    # "returned 2 outputs, reference returned 1" (its two arguments, counted as outputs).
    definition, kernels = toy
    in_place = dataclasses.replace(definition, make_inputs=kernels.two_inputs)
    decision = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0, "jit": 10.0}), device="cpu").tune(
        in_place, specs(torch="add_in_place_returning", triton="add_in_place", jit="add_in_place_zeroing_y"),
        reference=kernels.add_in_place_returning, shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test",
        versions={})
    assert decision.winner == "triton"
    assert decision.candidate("jit").reason.startswith("argument 1 after the call differs from the reference")


def test_a_candidate_returning_none_where_the_reference_returns_a_new_tensor_is_told_so(toy, monkeypatch):
    # Used to break: its arguments were taken for its outputs, so the reason never said that it returned None.
    definition, kernels = toy

    def doubles_returning_none(x):
        x.mul_(2)

    _plant(monkeypatch, kernels, doubles_returning_none=doubles_returning_none)
    decision = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu").tune(
        definition, specs(torch="fast", triton="doubles_returning_none"), reference=kernels.fast,
        shapes=kernels.SHAPES, mode="eager", platform_key="cpu/test", versions={})
    assert decision.winner == "torch"
    assert decision.candidate("triton").reason == ("returned None where the reference returned a torch.float32 "
                                                   "[65536] tensor at n=65536")


def zeros_when_small(shape: dict, device: str) -> tuple:
    """toy_kernels.inputs, but zeros below 1024 elements, where wrong_but_fast's x equals 2x: a kernel wrong only
    from some size on, as one wrong from some token count on."""
    import torch

    n = shape["n"]
    return (torch.zeros(n, device=device) if n < 1024 else torch.randn(n, device=device),)


def test_a_candidate_wrong_at_a_check_shape_is_rejected_though_right_at_every_timed_one(toy):
    # Tuned on given (recorded) shapes alone, a kernel wrong only at a representative shape passed the check and
    # won; every bucket the given shapes left out then ran its wrong output.
    _, kernels = toy
    definition = OpDefinition(OP, shapes=kernels.SHAPES, make_inputs=zeros_when_small, bucket=kernels.bucket)
    given = [{"n": 16}, {"n": 32}]
    candidates = specs(torch="slow", triton="fast", aot="wrong_but_fast")
    times = {"torch": 100.0, "triton": 50.0, "aot": 10.0}
    common = dict(reference=kernels.fast, shapes=given, mode="eager", platform_key="cpu/test", versions={})
    unchecked, _ = Tuner(timer=FakeTimer(times, noise=0.001), device="cpu").tune_buckets(
        definition, candidates, **common)
    assert unchecked.winner == "aot"  # right at every given shape: only the representative ones tell
    timer = FakeTimer(times, noise=0.001)
    decision, buckets = Tuner(timer=timer, device="cpu").tune_buckets(
        definition, candidates, check_shapes=[*kernels.SHAPES, given[0]], **common)
    assert decision.winner == "triton" and [b.winner for b in buckets] == ["triton", "triton"]
    aot = decision.candidate("aot")
    assert aot.status == "rejected" and aot.reason.endswith(f"at n={kernels.SIZE}")
    assert {n for _, n in timer.calls} == {16, 32}  # the check shapes are checked, not timed
    # The evidence is that of the timed shapes, as without check shapes, with the errors measured on them.
    assert [(s.shape, s.max_abs_err) for s in aot.shapes] == [({"n": 16}, 0.0), ({"n": 32}, 0.0)]
    assert [s.shape for s in decision.candidate("triton").shapes] == given


def test_a_make_inputs_error_of_several_lines_is_named_by_its_first_line(toy):
    # torch's overload list of a TypeError was embedded whole: `autosel tune`'s one-line error ran to many lines.
    definition, kernels = toy

    def inputs(shape, device):
        raise TypeError("randn() received an invalid combination of arguments - got (str, ), but expected one of:\n"
                        " * (tuple of ints size, *, torch.dtype dtype = None)\n")

    tuner = Tuner(timer=FakeTimer({"torch": 100.0, "triton": 50.0}), device="cpu")
    with pytest.raises(TuningError) as info:
        tuner.tune(dataclasses.replace(definition, make_inputs=inputs), specs(torch="fast", triton="fast"),
                   reference=kernels.fast, shapes=[{"n": "x"}], mode="eager", platform_key="cpu/test", versions={})
    assert str(info.value) == ("op 'toy.double': its make_inputs raised TypeError: randn() received an invalid "
                               "combination of arguments - got (str, ), but expected one of: [...] for the shape n=x: "
                               "fix the shape or the op's make_inputs")


def test_a_replay_can_set_the_heavy_host_step_of_eager_timing_only():
    from autosel.policy import DEFAULT_POLICY

    policy = DEFAULT_POLICY.with_heavy_host(1.5)
    assert policy.rule_for("cuda:back-to-back").heavy_host == 1.5
    assert policy.rule_for("cuda:graph-replay").heavy_host is None
    assert DEFAULT_POLICY.with_heavy_host(None).rule_for("cuda:back-to-back").heavy_host is None


def test_rules_shared_by_several_method_names_stay_shared_through_a_replay_s_changes():
    # --may-lose N then --floor cuda:graph-replay=F left the older name's copy of the graph rule at its old floor.
    from autosel.policy import DEFAULT_POLICY

    policy = DEFAULT_POLICY.with_may_lose(1).with_heavy_host(1.5).with_floor("cuda:graph-replay", 0.05)
    assert policy.rule_for("cuda:do_bench_cudagraph") is policy.rule_for("cuda:graph-replay")
    assert policy.rule_for("cuda:do_bench_cudagraph").floor == 0.05
    assert policy.rule_for("cuda:back-to-back").may_lose == 1
