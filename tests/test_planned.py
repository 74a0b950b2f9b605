"""Planned ops (autosel.planned): a plan per batch on its bucket's winner, the plan built outside the timed calls,
backends that cannot run a batch ineligible there, and the selector's contract kept for them."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import use_fresh_registry

from autosel import cli, selector, tuning
from autosel.decisions import Decision
from autosel.planned import Planner, UnsupportedBatch
from autosel.platforms import PlatformInfo
from autosel.spec import CapabilityRequirement, KernelBackend as B, KernelSpec, OpDefinition

HERE = Path(__file__).parent
CPU = PlatformInfo("cpu", arch="x86_64", device_name="test cpu", multiprocessor_count=2)
OP = "toy.scaled"
# Per backend, microseconds at n=1024 and n=4096: triton and the narrow backend lead at 1024, torch at 4096.
SPEED_US = {"torch": {1024: 100.0, 4096: 100.0}, "triton": {1024: 40.0, 4096: 300.0},
            "jit": {1024: 20.0, 4096: 20.0}, "aot": {1024: 30.0, 4096: 30.0}}


class PlanTimer:
    """Fixed times per backend and shape; counts the plans built while a timed call runs (there must be none)."""

    method = "fake"

    def __init__(self) -> None:
        self.plans_built_while_timed = 0

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        import toy_plans

        before = sum(toy_plans.built.values())
        fn()
        self.plans_built_while_timed += sum(toy_plans.built.values()) - before
        base = SPEED_US[backend][shape["n"]]
        return [base * (1 + 0.001 * i) for i in range(5)]


@pytest.fixture
def reg(monkeypatch):
    timer = PlanTimer()
    fresh = use_fresh_registry(monkeypatch, CPU, timer=timer)
    monkeypatch.syspath_prepend(str(HERE))
    import toy_plans

    toy_plans.built.clear()
    toy_plans.ran.clear()
    fresh.timer = timer
    return fresh


def toy(reg, *backends, planned=True):
    import toy_plans

    targets = {B.TORCH: "toy_plans:SlowPlan", B.TRITON: "toy_plans:FastPlan", B.AOT: "toy_plans:WrongPlan",
               B.JIT: "toy_plans_narrow:NarrowPlan"}
    for backend in backends:
        reg.register(KernelSpec(OP, backend, targets[backend]))
    reg.define(OpDefinition(OP, shapes=toy_plans.SHAPES, make_inputs=toy_plans.inputs, bucket=toy_plans.bucket,
                            shape_of=toy_plans.shape_of, planned=planned))


def test_a_planned_op_plans_each_batch_on_its_buckets_winner_and_runs_the_plan_many_times(reg):
    import torch
    import toy_plans

    toy(reg, B.TORCH, B.TRITON)
    planner = selector.get_kernel(OP)
    assert isinstance(planner, Planner)
    assert reg.timer.plans_built_while_timed == 0  # the tuner built every plan before its timed calls
    small, large = toy_plans.ToyBatch(1024, factor=3.0), toy_plans.ToyBatch(4096)
    assert (planner.backend_of(small), planner.backend_of(large)) == ("triton", "torch")
    toy_plans.built.clear()
    toy_plans.ran.clear()
    plan = planner.plan(small)
    x = torch.randn(1024)
    outs = [plan.run(x) for _ in range(4)]  # once per layer: no further choice, no further plan
    assert toy_plans.built == {"FastPlan": 1} and toy_plans.ran == {"FastPlan": 4}
    assert all(torch.equal(out, x * 3.0) for out in outs)
    assert type(planner.plan(large)).__name__ == "SlowPlan"
    # A one-off call plans and runs, as the checks call a candidate.
    assert torch.equal(planner(small, x), x * 3.0)


def test_a_batch_far_from_every_tuned_bucket_runs_the_nearest_buckets_winner(reg):
    import toy_plans

    toy(reg, B.TORCH, B.TRITON)
    planner = selector.get_kernel(OP)
    # 200 is 2.4 powers of two under the 1024 bucket (won by triton): a plain op's call that far runs the op-level
    # winner (torch), a planned op's batch the nearest tuned bucket (autosel.planned.PLANNED_NEAREST_WITHIN).
    assert planner.backend_of(toy_plans.ToyBatch(200)) == "triton"
    assert planner.backend_of(toy_plans.ToyBatch(1 << 16)) == "torch"  # nearest 4096


@pytest.mark.parametrize("mode, bucket_winner", [("graph", "triton"), ("eager", "torch")])
def test_a_planned_ops_graph_bucket_goes_to_its_fastest_through_a_tie(monkeypatch, reg, mode, bucket_winner):
    import toy_plans

    from autosel.tuner import Tuner

    # triton 1% ahead at 1024, inside the fake timer's 3% rule, and 3x behind at 4096: torch wins the op level. A
    # planned op's graph bucket once kept torch there, as eager buckets (and plain ops' buckets) still do.
    monkeypatch.setitem(SPEED_US, "triton", {1024: 99.0, 4096: 300.0})
    definition = OpDefinition(OP, shapes=toy_plans.SHAPES, make_inputs=toy_plans.inputs, bucket=toy_plans.bucket,
                              planned=True)
    specs = [KernelSpec(OP, B.TORCH, "toy_plans:SlowPlan"), KernelSpec(OP, B.TRITON, "toy_plans:FastPlan")]
    decision, buckets = Tuner(timer=reg.timer, device="cpu").tune_buckets(
        definition, specs, reference=Planner(OP, toy_plans.SlowPlan), shapes=toy_plans.SHAPES, mode=mode,
        platform_key="cpu/test", versions={})
    assert decision.winner == "torch"
    assert {d.bucket: d.winner for d in buckets} == {"[1024]": bucket_winner, "[4096]": "torch"}


def test_planned_decisions_are_stored_per_bucket_with_the_plan_building_time_as_evidence(reg):
    toy(reg, B.TORCH, B.TRITON)
    selector.get_kernel(OP)
    rows = {d.bucket: d for d, _ in tuning.database().decisions(OP)}
    assert {b: d.winner for b, d in rows.items()} == {"*": "torch", "[1024]": "triton", "[4096]": "torch"}
    for decision in rows.values():
        for candidate in decision.candidates:
            assert candidate.status == "ok"
            assert all(s.plan_us is not None and s.plan_us >= 0 for s in candidate.shapes)
    again = Decision.from_json(rows["*"].to_json())
    assert again.candidates[0].shapes[0].plan_us == rows["*"].candidates[0].shapes[0].plan_us


def test_rows_of_ops_that_are_not_planned_carry_no_plan_time(reg):
    # Rows written as they were before planned ops: no plan_us key, which an older autosel could not read.
    toy(reg, B.TORCH, B.TRITON, planned=False)
    row = Decision(op=OP, mode="eager", bucket="*", winner="torch", platform_key="k", versions={}, candidates=(),
                   margin=0.02)
    assert "plan_us" not in row.to_json()
    from autosel.decisions import CandidateResult, ShapeResult

    shape = ShapeResult(shape={"n": 1})
    row = Decision(op=OP, mode="eager", bucket="*", winner="torch", platform_key="k", versions={}, margin=0.02,
                   candidates=(CandidateResult("torch", "ok", shapes=(shape,)),))
    assert "plan_us" not in json.loads(row.to_json())["candidates"][0]["shapes"][0]


def test_a_wrong_plan_is_rejected_by_the_check_before_it_is_timed(reg):
    toy(reg, B.TORCH, B.AOT)
    planner = selector.get_kernel(OP)
    decision = tuning.database().decisions(OP)[0][0]
    wrong = decision.candidate("aot")
    assert wrong.status == "rejected" and wrong.reason.startswith("output differs from the reference: max abs error")
    assert planner.backend_of(__import__("toy_plans").ToyBatch(1024)) == "torch"


# --- backends that cannot run some batches ---------------------------------------------------------------------

def test_a_backend_that_cannot_run_a_shape_is_ineligible_there_with_its_reason_and_wins_where_it_runs(reg):
    toy(reg, B.TORCH, B.JIT)
    planner = selector.get_kernel(OP)
    rows = {d.bucket: d for d, _ in tuning.database().decisions(OP)}
    # jit is fastest at both shapes but runs n <= 1100 only: it wins the 1024 bucket, never the op level (which
    # untuned buckets run) nor 4096.
    assert {b: d.winner for b, d in rows.items()} == {"*": "torch", "[1024]": "jit", "[4096]": "torch"}
    for bucket in ("*", "[4096]"):
        jit = rows[bucket].candidate("jit")
        assert (jit.status, jit.reason) == ("unsupported", "does not support n=4096: n=4096 is over this kernel's 1100")
    assert rows["[1024]"].candidate("jit").status == "ok"
    show = CliRunner().invoke(cli.main, ["show", "--op", OP], env={"COLUMNS": "250"})
    assert show.exit_code == 0, show.output
    assert "jit: unsupported: does not support n=4096: n=4096 is over this kernel's 1100" in show.output


def test_a_batch_its_buckets_winner_cannot_run_is_planned_on_the_first_backend_that_can(reg):
    import torch
    import toy_plans

    toy(reg, B.TORCH, B.JIT)
    planner = selector.get_kernel(OP)
    # 1500 is nearest the 1024 bucket, won by jit, which cannot run it: torch (registered first) plans it.
    batch = toy_plans.ToyBatch(1500)
    assert planner.backend_of(batch) == "torch"
    x = torch.randn(1500)
    assert type(planner.plan(batch)).__name__ == "SlowPlan" and torch.equal(planner(batch, x), x * 2.0)


def test_an_explicit_backend_that_cannot_run_a_batch_raises_with_its_reason(reg):
    import toy_plans

    toy(reg, B.TORCH, B.JIT)
    planner = selector.get_kernel(OP, backend="jit")
    with pytest.raises(UnsupportedBatch, match=r"toy.scaled: no backend can run this batch: jit: n=4096 is over"):
        planner.plan(toy_plans.ToyBatch(4096))


# --- the contract ----------------------------------------------------------------------------------------------

def test_an_explicit_backend_plans_on_it_without_tuning(reg):
    import toy_plans

    toy(reg, B.TORCH, B.TRITON)
    planner = selector.get_kernel(OP, backend="torch")
    assert type(planner.plan(toy_plans.ToyBatch(1024))).__name__ == "SlowPlan"
    assert tuning.database().decisions(OP) == []
    with pytest.raises(KeyError, match="No 'aot' backend registered for op 'toy.scaled'"):
        selector.get_kernel(OP, backend="aot")


def test_autosel_backend_forces_a_planned_ops_backend(reg, monkeypatch):
    import toy_plans

    toy(reg, B.TORCH, B.TRITON)
    monkeypatch.setenv("AUTOSEL_BACKEND", f"{OP}=torch")
    planner = selector.get_kernel(OP)
    assert planner.backend_of(toy_plans.ToyBatch(1024)) == "torch"
    assert tuning.database().decisions(OP) == []


def test_a_planned_op_with_no_eligible_backend_raises_the_original_error(reg):
    for backend in (B.FLASHINFER, B.SGL_KERNEL):
        reg.register(KernelSpec(OP, backend, "toy_plans:FastPlan", capabilities={CapabilityRequirement.CUDA}))
    with pytest.raises(ValueError, match=r"^op 'toy.scaled' has no backend usable on device 'cpu' \(registered: "
                                         r"\['flashinfer', 'sgl_kernel'\]\)$"):
        selector.get_kernel(OP)


def test_tuning_off_with_nothing_stored_raises_the_multiple_backends_error(reg, monkeypatch):
    toy(reg, B.TORCH, B.TRITON)
    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    with pytest.raises(ValueError, match=r"^op 'toy.scaled' has multiple backends usable on device 'cpu' "
                                         r"\(\['torch', 'triton'\]\); pass backend=\.\.\. to choose one .*AUTOSEL_TUNE=off"):
        selector.get_kernel(OP)


def test_a_planned_op_is_checked_in_isolation_in_a_child_process(reg, monkeypatch):
    import toy_plans

    toy(reg, B.TORCH, B.TRITON, B.AOT)
    definition = reg.definition(OP)
    recorded = tuning.tune_and_record(definition, reg.get(OP), platform=CPU, mode="eager", db=tuning.database(),
                                      budget_s=5, isolate_timeout_s=60)
    statuses = {c.backend: (c.status, c.reason) for c in recorded.decision.candidates}
    assert statuses["torch"] == ("ok", None) and statuses["triton"] == ("ok", None)
    assert statuses["aot"][0] == "rejected" and statuses["aot"][1].startswith("in isolation: output differs from the reference")
    assert toy_plans.built  # the parent built plans too: it timed them


RANKS = textwrap.dedent("""
    import datetime, json, os
    import torch.distributed as dist
    import toy_plans
    from autosel import selector
    from autosel.registry import KernelRegistry
    from autosel.spec import KernelSpec, KernelBackend as B, OpDefinition

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    fresh = KernelRegistry()
    selector.registry = fresh
    import autosel.tuning
    autosel.tuning.registry = fresh
    fresh.register(KernelSpec("toy.scaled", B.TORCH, "toy_plans:SlowPlan"))
    fresh.register(KernelSpec("toy.scaled", B.TRITON, "toy_plans:FastPlan"))
    fresh.define(OpDefinition("toy.scaled", shapes=toy_plans.SHAPES, make_inputs=toy_plans.inputs,
                              bucket=toy_plans.bucket, planned=True))
    if rank == 1:  # alone, with tuning off and an empty DB, this rank would raise "multiple backends"
        os.environ["AUTOSEL_TUNE"] = "off"
    planner = selector.get_kernel("toy.scaled")
    print(json.dumps({"rank": rank, "built": sum(toy_plans.built.values()),
                      "backends": [planner.backend_of(toy_plans.ToyBatch(n)) for n in (1024, 4096, 3000)]}))
    dist.destroy_process_group()
""")


def test_every_rank_plans_on_rank_zeros_decision(tmp_path):
    from test_distributed import run_ranks

    results, _ = run_ranks(RANKS, 2, tmp_path, AUTOSEL_BUDGET_S="5")
    assert results[0]["backends"] == results[1]["backends"]
    assert results[0]["built"] > 0 and results[1]["built"] == 0  # rank 0 tuned; rank 1 took its table


def test_show_report_and_check_read_a_planned_ops_rows(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    selector.get_kernel(OP)
    show = CliRunner().invoke(cli.main, ["show", "--op", OP], env={"COLUMNS": "250"})
    assert show.exit_code == 0, show.output
    lines = [line for line in show.output.splitlines() if line.lstrip().startswith(OP)]
    assert [line.split()[2] for line in lines] == ["*", "[1024]", "[4096]"]
    assert all(", plan " in line for line in lines)  # the plan-building time beside each candidate's median
    out = tmp_path / "report.html"
    report = CliRunner().invoke(cli.main, ["report", "--out", str(out), "--op", OP])
    assert report.exit_code == 0, report.output
    assert "(plan " in out.read_text()
    check = CliRunner().invoke(cli.main, ["check", "--require", OP, "--buckets"])
    assert check.exit_code == 0, check.output


def test_a_backend_that_cannot_run_a_shape_passes_its_isolated_check_on_the_others(reg):
    # The child called it again at every shape after its check, the ones it cannot run too.
    toy(reg, B.TORCH, B.JIT)
    recorded = tuning.tune_and_record(reg.definition(OP), reg.get(OP), platform=CPU, mode="eager",
                                      db=tuning.database(), budget_s=5, isolate_timeout_s=60)
    assert {b.bucket: b.winner for b in recorded.buckets} == {"[1024]": "jit", "[4096]": "torch"}


def test_backends_that_each_cannot_run_some_shape_leave_no_op_level_winner_and_say_why(reg):
    # The first round's comparison of the candidates over the shapes they all run had no shape to compare on.
    from autosel.errors import NoCandidateError

    reg.register(KernelSpec(OP, B.JIT, "toy_plans_narrow:NarrowPlan"))
    reg.register(KernelSpec(OP, B.AOT, "toy_plans_wide:WidePlan"))
    toy(reg)
    with pytest.raises(NoCandidateError, match=r"no candidate runs every shape \(jit: does not support n=4096: .*; "
                                               r"aot: does not support n=1024: n=1024 is not over"):
        tuning.tune_and_record(reg.definition(OP), reg.get(OP), platform=CPU, mode="eager", db=tuning.database(),
                               budget_s=5, reference=lambda batch, x: x * batch.factor)
