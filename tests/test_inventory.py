"""What each stored row means on this machine; here, bucket rows beside their op-level row."""

from __future__ import annotations

from dataclasses import dataclass, replace

from autosel.decisions import CandidateResult, Decision
from autosel.inventory import Inventory
from autosel.platforms import PlatformInfo, version_vector
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition

CPU = PlatformInfo("cpu", arch="x86_64", device_name="test cpu", multiprocessor_count=2)


@dataclass
class Layer:
    path: str
    kind: str


SPECS = [KernelSpec("toy.op", B.TORCH, "toy_kernels:fast"), KernelSpec("toy.op", B.TRITON, "toy_kernels:slow")]


def row(bucket: str, winner: str) -> Decision:
    return Decision(op="toy.op", mode="eager", bucket=bucket, winner=winner, platform_key=CPU.key,
                    versions=version_vector(CPU, SPECS),
                    candidates=(CandidateResult("torch", "ok"), CandidateResult("triton", "ok")), margin=0.05)


def test_bucket_rows_are_in_use_only_beside_the_op_level_row_in_use():
    # Used to break: a shipped layer's bucket rows showed "in use" though the user layer's op-level row was
    # used, and get_kernel reads bucket rows only from the layer its op-level decision came from.
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(spec)
    inventory = Inventory(CPU, registry)
    user, shipped = Layer("user.db", "user"), Layer("shipped.db", "shipped")
    entries = inventory.entries([(row("*", "torch"), user), (row("*", "triton"), shipped),
                                 (row("[1]", "triton"), shipped), (row("[2]", "torch"), user)])
    status = {(e.layer_kind, e.decision.bucket): e.status for e in entries}
    assert status == {("user", "*"): "in use", ("shipped", "*"): "shadowed", ("shipped", "[1]"): "shadowed",
                      ("user", "[2]"): "in use"}
    detail = next(e.detail for e in entries if e.decision.bucket == "[1]")
    assert "its op-level row in this layer is shadowed" in detail


def test_bucket_rows_without_their_op_level_row_do_not_shadow_the_rows_selection_reads():
    # The user layer's orphan bucket rows took the key first and marked the shipped layer's bucket rows shadowed,
    # though selection ran the shipped op-level row with those very bucket rows.
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(spec)
    user, shipped = Layer("user.db", "user"), Layer("shipped.db", "shipped")
    entries = Inventory(CPU, registry).entries([(row("[1]", "torch"), user), (row("*", "triton"), shipped),
                                                (row("[1]", "triton"), shipped)])
    status = {(e.layer_kind, e.decision.bucket): e.status for e in entries}
    assert status == {("user", "[1]"): "shadowed", ("shipped", "*"): "in use", ("shipped", "[1]"): "in use"}
    assert "this layer has no op-level row for its tune" in next(e.detail for e in entries if e.layer_kind == "user")


def test_rows_of_an_op_with_no_backend_runnable_here_are_unusable_not_stale_and_never_pruned():
    # Without torch installed every backend of the built-in ops is ineligible: their rows read "stale: versions
    # differ: autosel 0.1.0 -> (none)", and `autosel prune` there deleted every one of them.
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(KernelSpec(spec.op, spec.backend, spec.target, requires=("no_such_package_here",)))
    inventory = Inventory(CPU, registry)
    stored = replace(row("*", "torch"), versions={"torch": "2.13.0+cpu"})  # tuned where torch was installed
    [entry] = inventory.entries([(stored, Layer("user.db", "user"))])
    assert (entry.status, entry.detail) == ("unusable", "no backend of this op can run here (`autosel doctor` says "
                                                        "why)")
    assert inventory.prunable(stored) is None


def test_a_decision_that_never_timed_a_backend_eligible_here_is_stale_with_its_buckets():
    # A backend registered after the tune (a plug-in's new kernel) was never timed: the row stayed "in use".
    registry = KernelRegistry()
    for spec in SPECS + [KernelSpec("toy.op", B.JIT, "toy_kernels:fast")]:
        registry.register(spec)
    entries = Inventory(CPU, registry).entries([(row("*", "torch"), Layer("user.db", "user")),
                                                (row("[1]", "triton"), Layer("user.db", "user"))])
    assert [(e.status, e.detail.split(":")[0]) for e in entries] == [
        ("stale", "never timed jit, eligible here since it was made"),
        ("shadowed", "its op-level row in this layer is stale; get_kernel reads bucket rows beside the op-level "
                     "decision it uses")]


def test_a_decision_whose_bucket_rows_run_a_backend_gone_since_is_stale_with_its_buckets():
    # show called it "in use" while its bucket rows were "unusable"; selection now tunes such a table again.
    registry = KernelRegistry()
    registry.register(SPECS[0])
    registry.register(KernelSpec("toy.op", B.JIT, "toy_kernels:fast"))
    decision = replace(row("*", "torch"), candidates=(CandidateResult("torch", "ok"), CandidateResult("jit", "ok"),
                                                     CandidateResult("triton", "ok")))
    entries = Inventory(CPU, registry).entries([(decision, Layer("user.db", "user")),
                                                (replace(decision, bucket="[1]", winner="triton"),
                                                 Layer("user.db", "user"))])
    assert [(e.status, e.detail.split(":")[0]) for e in entries] == [
        ("stale", "has bucket rows that run triton, not eligible here since it was made"),
        ("unusable", "winner 'triton' is not eligible here (eligible")]


def test_a_decision_checked_with_other_tolerances_than_the_ops_now_is_stale():
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(spec)
    registry.define(OpDefinition("toy.op", shapes=[{"n": 1}], make_inputs=lambda shape, device: (), atol=1e-2))
    then = replace(row("*", "torch"), checked_with="rtol=None, atol=0.001, reference the op's torch backend")
    [entry] = Inventory(CPU, registry).entries([(then, Layer("user.db", "user"))])
    assert (entry.status, entry.detail) == ("stale", "was checked with rtol=None, atol=0.001, reference the op's "
                                                     "torch backend; the op is checked with rtol=None, atol=0.01, "
                                                     "reference the op's torch backend now: `autosel tune` times the "
                                                     "eligible backends again")
    [entry] = Inventory(CPU, registry).entries([(replace(then, checked_with=""), Layer("user.db", "user"))])
    assert entry.status == "in use"  # a row stored before the check was kept cannot tell


def checked(atol: float) -> KernelRegistry:
    """The toy op's two backends, checked with `atol` now."""
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(spec)
    registry.define(OpDefinition("toy.op", shapes=[{"n": 1}], make_inputs=lambda shape, device: (), atol=atol))
    return registry


ATOL_02 = "rtol=None, atol=0.02, reference the op's torch backend"
ATOL_5 = "rtol=None, atol=0.5, reference the op's torch backend"


def near(torch: str, checked_with: str, created_at: str, winner: str = "torch") -> Decision:
    """An op-level row of this platform stored under another torch: a near row under AUTOSEL_MATCH=device."""
    now = row("*", winner)
    return replace(now, versions={**now.versions, "torch": torch}, checked_with=checked_with, created_at=created_at)


def test_a_near_row_checked_with_other_tolerances_is_not_in_use():
    # Used to break: with AUTOSEL_MATCH=device show called a near row checked with atol=0.5 "in use" while
    # selection (lookup_near, fits=tuning.outdated) passed it over and tuned again.
    [entry] = Inventory(CPU, checked(0.02), match="device").entries(
        [(near("1.0.0", ATOL_5, "2026-01-01T00:00:00+00:00"), Layer("user.db", "user"))])
    assert (entry.status, entry.near) == ("stale", False)
    assert entry.detail.endswith(f"; not taken as a near match (AUTOSEL_MATCH=device): it was checked with {ATOL_5}; "
                                 f"the op is checked with {ATOL_02} now")


def test_the_near_match_is_the_closest_row_that_selection_s_rule_accepts():
    # show took the newest near row (or the exact key's own outdated row, "near match: same key") without asking
    # tuning.outdated; lookup_near takes the newest row that fits.
    user = Layer("user.db", "user")
    exact = replace(row("*", "triton"), checked_with=ATOL_5, created_at="2026-03-01T00:00:00+00:00")
    newest = near("1.0.0", ATOL_5, "2026-02-01T00:00:00+00:00", winner="triton")
    fits = near("0.9.0", ATOL_02, "2026-01-01T00:00:00+00:00")
    entries = Inventory(CPU, checked(0.02), match="device").entries([(exact, user), (newest, user), (fits, user)])
    assert [(e.decision.versions.get("torch"), e.status, e.near) for e in entries] == [
        (None, "stale", False), ("1.0.0", "stale", False), ("0.9.0", "in use", True)]
    assert entries[2].detail == "near match: versions differ: torch 0.9.0 -> (none)"


def test_a_graph_decision_timed_on_one_copy_of_the_ops_weights_is_stale():
    # Replayed on one weight that fits in the L2, triton and cuBLAS ranked 2816 x 5120 at 8-16 tokens oppositely
    # to a model step, which reads the weight from memory (commit f981d83).
    registry = KernelRegistry()
    for spec in SPECS:
        registry.register(spec)
    registry.define(OpDefinition("toy.op", shapes=[{"n": 1}], make_inputs=lambda shape, device: (), weights=(1,)))
    graph = replace(row("*", "torch"), mode="graph", method="cuda:graph-replay, activations written")

    def status(decision: Decision, on: KernelRegistry = registry) -> tuple[str, str]:
        [entry] = Inventory(CPU, on).entries([(decision, Layer("user.db", "user"))])
        return entry.status, entry.detail

    assert status(graph) == ("stale", "was timed replaying one copy of its weights, which the L2 can hold; graph "
                                      "timing reads them from memory now (docs/TUNING.md section 2): "
                                      "`autosel tune` times the eligible backends again")
    assert status(replace(graph, method=graph.method + ", weights from memory"))[0] == "in use"
    assert status(replace(graph, mode="eager", method="cuda:back-to-back"))[0] == "in use"  # eager rotates copies
    assert status(graph, checked(0.02))[0] == "in use"  # an op that declares no weights
