"""Many ranks, one decision: with a process group up, every rank runs rank 0's winner (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import use_platform, use_registry

import autosel.tuner
from autosel import state
from autosel import config, platforms, tuning
from autosel.dispatch import BucketTable
from autosel.rank_check import RankDifference, check_against_local, differences
from autosel.errors import TuningError
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec

HERE = Path(__file__).parent


def table(default: str, **winners: str) -> BucketTable:
    """A bucket table of toy.op whose buckets are written as keyword names: n16="torch" is bucket (16,)."""
    return BucketTable("toy.op", "eager", default, {(int(k[1:]),): w for k, w in winners.items()})


@pytest.mark.parametrize("local, agreed, expected", [
    (table("torch", n16="torch"), table("torch", n16="torch"), []),
    (None, table("triton"), [RankDifference(None, None, "triton")]),
    (table("torch"), table("triton"), [RankDifference(None, "torch", "triton")]),
    # Buckets in either table, in order; each side routed as its dispatcher would route it:
    (table("torch", n1024="triton", n16="torch"), table("torch", n16="triton"),
     [RankDifference((16,), "torch", "triton"), RankDifference((1024,), "triton", "torch")]),
    # (32,) is tuned here only; rank 0 routes it to its nearest bucket (16,), which agrees:
    (table("torch", n32="triton"), table("torch", n16="triton"), []),
    (table("triton", n16="torch"), table("torch", n16="torch"), [RankDifference(None, "triton", "torch")]),
])
def test_differences_of_a_local_table_from_rank_zeros(local, agreed, expected):
    assert differences(local, agreed) == expected


def test_a_difference_reads_as_a_sentence():
    assert [str(d) for d in (RankDifference(None, None, "triton"), RankDifference((16, 4096), "torch", "triton"))] == [
        "op level: nothing stored here, triton on rank 0", "bucket [16, 4096]: torch here, triton on rank 0"]


def test_a_single_process_has_nothing_to_compare():
    def local():
        raise AssertionError("looked up without a process group")

    assert check_against_local(table("torch"), local, what="op 'toy.op' (eager mode)") == []

RANK = textwrap.dedent("""
    import datetime, json, os
    import torch
    import torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.spec import KernelSpec, KernelBackend as B, OpDefinition

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))  # a mismatched collective fails, not hangs
    timed = toy_kernels.use_fresh_registry()
    reg = selector.registry
    reg.register(KernelSpec("toy.missing_shapes", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.missing_shapes", B.TRITON, "toy_kernels:fast"))
    if rank == 1:  # alone, with tuning off and an empty DB, this rank would raise "multiple backends"
        os.environ["AUTOSEL_TUNE"] = "off"
    winner = selector.select_kernel("toy.double").backend.value
    again = None
    if rank == 0:  # an agreed op's later selections are no collectives: rank 0 alone may make them
        again = [selector.select_kernel("toy.double").backend.value,
                 selector.get_kernel("toy.double", mode="eager").__name__]
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the ranks' next collective: a broadcast made by rank 0 alone above would mismatch it
    try:
        selector.select_kernel("toy.missing_shapes")
        error = None
    except ValueError as exc:
        error = str(exc)
    reg.register(KernelSpec("toy.split", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.split", B.TRITON, "toy_kernels:overhead"))
    reg.define(OpDefinition("toy.split", shapes=toy_kernels.SPLIT_SHAPES, make_inputs=toy_kernels.inputs,
                            bucket=toy_kernels.bucket))
    if rank == 1:  # this rank's own DB holds the opposite table: it still runs rank 0's, and says how they differ
        toy_kernels.plant("toy.split", "triton", {(16,): "triton", (1 << 20,): "torch"})
    table = selector.get_kernel("toy.split").table
    reg.register(KernelSpec("toy.broken", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.broken", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.broken", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.broken_inputs))
    try:
        selector.select_kernel("toy.broken")
        broken = None
    except Exception as exc:
        broken = f"{type(exc).__name__}: {exc}"
    reg.register(KernelSpec("toy.untuned", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.untuned", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.untuned", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    os.environ["AUTOSEL_TUNE"] = "off"  # on every rank now, and nothing is stored for toy.untuned anywhere
    try:
        selector.select_kernel("toy.untuned")
        off = None
    except ValueError as exc:
        off = str(exc)
    print(json.dumps({"rank": rank, "winner": winner, "timed": len(timed), "error": error, "default": table.default,
                      "table": sorted([list(k), w] for k, w in table.winners.items()), "broken": broken,
                      "off": off, "again": again, "all_reduce": ones.item()}))
    dist.destroy_process_group()
""")


def run_ranks(script: str, ranks: int, tmp_path: Path, **env: str) -> tuple[list[dict], list[str]]:
    """Run `script` as `ranks` processes under gloo, each with a DB of its own: the JSON each printed last, and
    each one's stderr."""
    procs = []
    for rank in range(ranks):
        procs.append(subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=dict(os.environ, RANK=str(rank), INIT_FILE=str(tmp_path / "init"), PYTHONPATH=str(HERE),
                     AUTOSEL_DB=str(tmp_path / f"rank{rank}.db"), **env)))
    results, errs = [], []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
            errs.append(err)
    finally:  # a rank that failed or hung leaves none of the others running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return results, errs


def test_every_rank_runs_rank_zeros_winner_and_gets_its_errors(tmp_path):
    results, errs = run_ranks(RANK, 2, tmp_path, AUTOSEL_CHECK_RANKS="1",
                              AUTOSEL_BUDGET_S="5")  # the toys differ 4x or more: on a busy machine, no 30 s tunes
    logs = [[line for line in err.splitlines() if "on its own would differ" in line] for err in errs]
    # rank 0 tuned toy.double, toy.split and toy.broken; rank 1 none of them
    assert [(r["rank"], r["winner"], r["timed"]) for r in results] == [(0, "triton", 3), (1, "triton", 0)]
    # Used to time out: every select_kernel, and get_kernel with another mode= or backend=, was a broadcast.
    assert [(r["again"], r["all_reduce"]) for r in results] == [(["triton", "fast"], 2.0), (None, 2.0)]
    assert results[0]["error"].startswith("op 'toy.missing_shapes' has multiple backends usable")
    assert results[1]["error"] == results[0]["error"] + " (decided on rank 0 of 2)"
    # The whole bucket table is rank 0's: rank 1, with tuning off and an empty DB, dispatches alike.
    assert results[0]["table"] == results[1]["table"] == [[[16], "torch"], [[1 << 20], "triton"]]
    assert results[0]["default"] == results[1]["default"]
    # AUTOSEL_CHECK_RANKS=1: rank 1 says where its own DB differs (nothing stored for toy.double; the opposite
    # table for toy.split); rank 0 runs its own answer and says nothing.
    default = results[0]["default"]
    split = ([f"op level: triton here, {default} on rank 0"] if default != "triton" else []) + [
        "bucket [16]: triton here, torch on rank 0", "bucket [1048576]: torch here, triton on rank 0"]
    assert [line.split(". [AUTOSEL_CHECK_RANKS")[0] for line in logs[1]] == [
        "op 'toy.double' (eager mode): rank 1 of 2 runs rank 0's decision, and on its own would differ: op level: "
        "nothing stored here, triton on rank 0",
        "op 'toy.split' (eager mode): rank 1 of 2 runs rank 0's decision, and on its own would differ: "
        + "; ".join(split)]
    assert logs[0] == []
    # Used to hang: a RuntimeError on rank 0 was raised before the broadcast, rank 1 waited forever.
    broken = "op 'toy.broken': its make_inputs raised RuntimeError: input factory failed (simulated) for the shape"
    assert results[0]["broken"].startswith(f"TuningError: {broken}")
    assert results[1]["broken"].startswith(f"TuningError: op 'toy.broken' (eager mode): rank 0 failed with "
                                           f"TuningError: {broken}")
    # AUTOSEL_TUNE=off on every rank and nothing stored: the same error everywhere, rank 1's saying whose it is.
    assert results[0]["off"].startswith("op 'toy.untuned' has multiple backends usable") and "AUTOSEL_TUNE=off" in \
        results[0]["off"]
    assert results[1]["off"] == results[0]["off"] + " (decided on rank 0 of 2)"


STAGE = textwrap.dedent("""
    import datetime, json, os
    import torch.distributed as dist
    import toy_kernels
    from autosel import distributed, selector
    from autosel.spec import KernelBackend as B, KernelSpec

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    stages = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group, in one order
    distributed.set_group(stages[rank // 2])
    toy_kernels.use_fresh_registry()
    selector.registry.register(KernelSpec("toy.other", B.TORCH, "toy_kernels:slow"))
    selector.registry.register(KernelSpec("toy.other", B.TRITON, "toy_kernels:fast"))
    if rank == 0:
        toy_kernels.plant("toy.double", "torch", {})
    if rank == 2:  # the other stage's first rank stores other winners, and decides for its stage
        toy_kernels.plant("toy.double", "triton", {})
        toy_kernels.plant("toy.other", "torch", {})
    os.environ["AUTOSEL_TUNE"] = "off"  # the others store nothing: they run what their stage's first rank sends
    picks = [selector.select_kernel("toy.double").backend.value]
    if rank >= 2:  # an op one stage selects and the other never does: a broadcast in that stage only
        picks.append(selector.select_kernel("toy.other").backend.value)
    selector.registry.register(KernelSpec("toy.none", B.TORCH, "toy_kernels:slow"))
    selector.registry.register(KernelSpec("toy.none", B.TRITON, "toy_kernels:fast"))
    try:  # stored nowhere, tuning off: each stage's first rank fails, and says so to its stage
        selector.select_kernel("toy.none")
        error = None
    except ValueError as exc:
        error = str(exc)
    print(json.dumps({"rank": rank, "picks": picks, "error": error}))
    dist.destroy_process_group()
""")


def test_with_a_group_per_pipeline_stage_each_stage_runs_its_first_ranks_decision(tmp_path):
    # Agreeing over every rank, stages that select different ops paired one stage's broadcast with the other's.
    results, _ = run_ranks(STAGE, 4, tmp_path)
    assert [(r["rank"], r["picks"]) for r in results] == [
        (0, ["torch"]), (1, ["torch"]), (2, ["triton", "torch"]), (3, ["triton", "torch"])]
    # Ranks are numbered within the stage; a message says which process decided.
    assert results[1]["error"] == results[0]["error"] + (
        " (decided on rank 0 of 2, in the group given to set_group, whose rank 0 is global rank 0)")
    assert results[3]["error"] == results[2]["error"] + (
        " (decided on rank 0 of 2, in the group given to set_group, whose rank 0 is global rank 2)")


REGROUP = textwrap.dedent("""
    import datetime, json, os
    import torch.distributed as dist
    import toy_kernels
    from autosel import distributed, selector
    from autosel.errors import TuningError
    from autosel.spec import KernelBackend as B, KernelSpec

    rank = int(os.environ["RANK"])

    def up(init):
        dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"] + init, rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=60))

    up("1")
    toy_kernels.use_fresh_registry()
    selector.registry.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    selector.registry.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    if rank == 0:
        toy_kernels.plant("toy.double", "triton", {})
    os.environ["AUTOSEL_TUNE"] = "off"
    alone = dist.new_group([0])  # rank 1 gets GroupMember.NON_GROUP_MEMBER
    try:
        distributed.set_group(alone)
        refused = None
    except TypeError as exc:
        refused = str(exc)
    distributed.set_group(dist.new_group([0, 1]))
    first = selector.select_kernel("toy.double").backend.value
    dist.destroy_process_group()
    up("2")  # a new process group: the group given to set_group went with the old one
    selector.clear_cache()
    try:
        selector.select_kernel("toy.double")
        stale = None
    except TuningError as exc:
        stale = str(exc)
    distributed.set_group(None)
    again = selector.select_kernel("toy.double").backend.value
    print(json.dumps({"rank": rank, "refused": refused, "first": first, "stale": stale, "again": again}))
    dist.destroy_process_group()
""")


def test_set_group_refuses_a_group_this_rank_is_not_in_and_a_group_gone_with_its_process_group(tmp_path):
    # A rank outside the group was told its argument was not a process group ("got -100"); a group destroyed with
    # its process group failed every selection in torch ("Group ... is not registered", a ValueError).
    results, _ = run_ranks(REGROUP, 2, tmp_path)
    assert results[0]["refused"] is None
    assert results[1]["refused"] == ("set_group was given GroupMember.NON_GROUP_MEMBER: rank 1 is not in that group "
                                     "(dist.new_group returns it on the ranks outside the group); give each rank the "
                                     "group it belongs to")
    for r in results:
        assert r["first"] == r["again"] == "triton"
        assert r["stale"].startswith("the process group given to autosel.distributed.set_group is gone (destroyed "
                                     "with the process group it belonged to?); call set_group again")


PLUGIN_ON_ONE_RANK = textwrap.dedent("""
    import datetime, json, os
    import torch
    import torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.errors import TuningError
    from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    toy_kernels.use_fresh_registry()
    reg = selector.registry
    reg.register(KernelSpec("toy.solo", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.other", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.other", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.other", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    if rank == 1:  # a plug-in installed here only: toy.solo gets a second backend
        reg.register(KernelSpec("toy.solo", B.TRITON, "toy_kernels:fast"))
    first = selector.select_kernel("toy.double").backend.value  # agreed alike; rank 1 warns of toy.solo
    error = None
    if rank == 0:  # toy.solo alone (one backend here), then toy.other's agreement
        solo = selector.select_kernel("toy.solo").backend.value
        other = selector.select_kernel("toy.other").backend.value
    else:  # toy.solo's agreement, which pairs with rank 0's toy.other
        solo = other = None
        try:
            selector.select_kernel("toy.solo")
        except TuningError as exc:
            error = str(exc)
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the ranks' collectives still pair up
    print(json.dumps({"rank": rank, "first": first, "solo": solo, "other": other, "error": error,
                      "all_reduce": ones.item()}))
    dist.destroy_process_group()
""")


def test_a_plug_in_on_one_rank_only_is_named_before_and_when_the_ranks_agreements_part(tmp_path):
    # The rank without the plug-in selected toy.solo alone while the other waited in its broadcast: a hang, or (with
    # another agreement after it) an error that blamed the order of the selections.
    results, errs = run_ranks(PLUGIN_ON_ONE_RANK, 2, tmp_path)
    gap = "op 'toy.solo' (rank 0: torch; here: torch, triton)"
    assert [r["first"] for r in results] == ["triton", "triton"]
    assert (results[0]["solo"], results[0]["other"], results[0]["error"]) == ("torch", "triton", None)
    assert results[1]["error"] == (
        "op 'toy.solo' (eager mode): rank 1 of 2 received rank 0's decision for op 'toy.other' (eager mode) instead: "
        f"the ranks register other backends for {gap}, so a rank selected such an op alone (one backend registered "
        "there) or agreed on it alone; install the same plug-ins on every rank and register their backends before "
        "selecting")
    assert f"rank 1 of 2 registers other backends than rank 0 for {gap}" in errs[1]
    assert "registers other backends" not in errs[0]
    assert [r["all_reduce"] for r in results] == [2.0, 2.0]


GROW = textwrap.dedent("""
    import datetime, json, os
    import torch
    import torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    timed = toy_kernels.use_fresh_registry()
    reg = selector.registry
    reg.register(KernelSpec("toy.grow", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.grow", B.CUTE_DSL, "toy_kernels:nan"))  # wrong: torch wins without triton
    reg.define(OpDefinition("toy.grow", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    if rank == 1:  # runs whatever rank 0 sends: alone, with tuning off and an empty DB, it would raise
        os.environ["AUTOSEL_TUNE"] = "off"
    before = selector.get_kernel("toy.grow").__name__
    reg.register(KernelSpec("toy.grow", B.TRITON, "toy_kernels:fast"))  # a plug-in's, on every rank
    after = selector.get_kernel("toy.grow").__name__
    ones = torch.ones(1)
    dist.all_reduce(ones)  # the ranks' collectives still pair up
    print(json.dumps({"rank": rank, "before": before, "after": after, "timed": len(timed),
                      "all_reduce": ones.item()}))
    dist.destroy_process_group()
""")


def test_a_backend_registered_on_every_rank_is_agreed_on_again(tmp_path):
    # get_kernel forgot the op's kernels, but every rank kept serving the table agreed before the registration:
    # the new backend was never timed on a multi-rank run, until clear_cache().
    results, _ = run_ranks(GROW, 2, tmp_path, AUTOSEL_BUDGET_S="5")
    assert [(r["rank"], r["before"], r["after"], r["timed"], r["all_reduce"]) for r in results] == [
        (0, "slow", "fast", 2, 2.0), (1, "slow", "fast", 0, 2.0)]


# The end of a rank's script that selected kernels into `picks`: the ranks' next collective, which pairs up only if
# every selection before it did (a rank left waiting fails at the group's timeout), and what the rank prints.
PICKS_AND_ALL_REDUCE = textwrap.dedent("""
    ones = torch.ones(1)
    dist.all_reduce(ones)
    print(json.dumps({"rank": rank, "picks": picks, "all_reduce": ones.item()}))
    dist.destroy_process_group()
""")


# The start of a two-rank gloo script that selects toy ops with tuning off (a rank left waiting fails in 20 s).
TWO_RANKS_UNTUNED = textwrap.dedent("""
    import datetime, json, os
    import torch
    import torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.spec import KernelBackend as B, KernelSpec

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))  # a rank left waiting fails in 20 s
    toy_kernels.use_fresh_registry()
    os.environ["AUTOSEL_TUNE"] = "off"
""")


FEWER = TWO_RANKS_UNTUNED + textwrap.dedent("""
    # op: the ranks on which its torch and its triton backend are eligible; elsewhere each needs a package that
    # is not installed. Every rank registers both: the packages and devices the ranks see differ.
    seen = {"toy.one_on_1": ({0, 1}, {0}), "toy.one_on_0": ({0, 1}, {1}), "toy.none_on_1": ({0}, {0}),
            "toy.none_on_0": ({1}, {1})}
    picks = {}
    for op, (torch_on, triton_on) in seen.items():
        for backend, target, on in ((B.TORCH, "slow", torch_on), (B.TRITON, "fast", triton_on)):
            missing = () if rank in on else ("autosel_test_package_not_installed",)
            selector.registry.register(KernelSpec(op, backend, "toy_kernels:" + target, requires=missing))
        if rank == 0 and len(torch_on & triton_on) == 1:
            toy_kernels.plant(op, "triton", {})  # rank 0's stored decision, where it has two to choose from
        try:
            picks[op] = selector.select_kernel(op).backend.value
        except Exception as exc:
            picks[op] = f"{type(exc).__name__}: {exc}"
    if rank == 0:  # agreed: a later selection is no collective, so rank 0 may make it alone
        picks["again"] = selector.select_kernel("toy.one_on_0").backend.value
""") + PICKS_AND_ALL_REDUCE


def test_ranks_that_see_fewer_than_two_backends_still_agree_and_say_where_they_differ(tmp_path):
    # Used to hang: a rank with one usable backend (or none) returned it without the broadcast rank 0 made.
    results, _ = run_ranks(FEWER, 2, tmp_path)
    assert [r["all_reduce"] for r in results] == [2.0, 2.0]
    assert results[0]["picks"] == {"toy.one_on_1": "triton", "toy.one_on_0": "torch", "toy.none_on_1": "triton",
                                   "toy.none_on_0": "ValueError: op 'toy.none_on_0' has no backend usable on "
                                                    "device 'cpu' (registered: ['torch', 'triton'])",
                                   "again": "torch"}
    assert results[1]["picks"] == {
        "toy.one_on_1": "TuningError: op 'toy.one_on_1' (eager mode): rank 0 chose 'triton', which is not eligible "
                        "on rank 1 (eligible here: ['torch']); every rank must see the same device and packages, "
                        "and AUTOSEL_BACKEND alike",
        "toy.one_on_0": "torch",  # rank 0's one backend is every rank's, with no tuning anywhere
        "toy.none_on_1": "ValueError: op 'toy.none_on_1' has no backend usable on device 'cpu' (registered: "
                         "['torch', 'triton']) on rank 1 of 2, where rank 0 chose 'triton'; every rank must see the "
                         "same device and packages",
        "toy.none_on_0": results[0]["picks"]["toy.none_on_0"] + " (decided on rank 0 of 2)"}


FORCED = TWO_RANKS_UNTUNED + textwrap.dedent("""
    ops = ("toy.forced_on_1", "toy.forced_on_0", "toy.forced_alike", "toy.forced_apart", "toy.unregistered_on_1",
           "toy.unregistered_on_0", "toy.forced_later")
    for op in ops:
        selector.registry.register(KernelSpec(op, B.TORCH, "toy_kernels:slow"))
        selector.registry.register(KernelSpec(op, B.TRITON, "toy_kernels:fast"))
        if rank == 0:
            toy_kernels.plant(op, "torch", {})  # rank 0's stored decision where it is not forced
    picks = {}

    def pick(op, name=None):
        try:
            picks[name or op] = selector.select_kernel(op).backend.value
        except Exception as exc:
            picks[name or op] = f"{type(exc).__name__}: {exc}"

    pick("toy.forced_later")  # agreed before AUTOSEL_BACKEND is set: torch
    # AUTOSEL_BACKEND as each rank's launcher set it: differently on the two ranks for every op but two
    forced = {0: "toy.forced_on_0=triton,toy.forced_alike=triton,toy.forced_apart=torch,"
                 "toy.unregistered_on_0=flashinfer,toy.forced_later=triton",
              1: "toy.forced_on_1=triton,toy.forced_alike=triton,toy.forced_apart=triton,"
                 "toy.unregistered_on_1=flashinfer,toy.forced_later=triton"}[rank]
    os.environ["AUTOSEL_BACKEND"] = forced
    for op in ops:
        pick(op)
    selector.clear_cache()  # on every rank: the next selection of each op is agreed again, under AUTOSEL_BACKEND
    pick("toy.forced_later", "later, after clear_cache")
""") + PICKS_AND_ALL_REDUCE


def test_ranks_forced_differently_by_autosel_backend_raise_instead_of_hanging(tmp_path):
    # A rank that AUTOSEL_BACKEND forced returned its backend without the broadcast the others made: here rank 1 ran
    # triton where rank 0 ran torch, and took rank 0's broadcast for another op (with one such op alone, it hangs).
    results, _ = run_ranks(FORCED, 2, tmp_path)
    assert [r["all_reduce"] for r in results] == [2.0, 2.0]

    def apart(op, here, rank, rank0):
        return (f"TuningError: op {op!r} (eager mode): AUTOSEL_BACKEND forces {here!r} on rank {rank} of 2, but the "
                f"ranks' table for it runs {rank0!r} (rank 0's decision, made now or at the op's first selection); "
                "set AUTOSEL_BACKEND alike on every rank before selecting, and call clear_cache() on every rank after "
                "changing it")
    missing = "KeyError: \"No 'flashinfer' backend registered for op 'toy.unregistered_on_0'"
    assert results[0]["picks"] == {
        "toy.forced_on_1": "torch", "toy.forced_on_0": "triton", "toy.forced_alike": "triton",
        "toy.forced_apart": "torch", "toy.unregistered_on_1": "torch", "toy.unregistered_on_0": missing + '"',
        # changed after the op was agreed: the agreement stands until clear_cache(), as a single process would not
        "toy.forced_later": apart("toy.forced_later", "triton", 0, "torch"), "later, after clear_cache": "triton"}
    assert results[1]["picks"] == {
        "toy.forced_on_1": apart("toy.forced_on_1", "triton", 1, "torch"),  # rank 0 runs its stored decision
        "toy.forced_on_0": "triton",  # rank 0's table, as any: rank 1 is not forced
        "toy.forced_alike": "triton",
        "toy.forced_apart": apart("toy.forced_apart", "triton", 1, "torch"),
        "toy.unregistered_on_1": apart("toy.unregistered_on_1", "flashinfer", 1, "torch"),
        "toy.unregistered_on_0": missing + ' (decided on rank 0 of 2)"',  # rank 0's KeyError, raised on every rank
        "toy.forced_later": apart("toy.forced_later", "triton", 1, "torch"), "later, after clear_cache": "triton"}


DURING = textwrap.dedent("""
    import datetime, json, os, threading, time
    import torch
    import torch.distributed as dist
    import toy_kernels
    from autosel import distributed, selector, state, tuning
    from autosel.spec import KernelBackend as B, KernelSpec

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))  # a rank left waiting fails in 20 s
    toy_kernels.use_fresh_registry()
    reg = selector.registry
    os.environ["AUTOSEL_TUNE"] = "off"
    for op in ("toy.late_on_1", "toy.late_on_0", "toy.late_get"):
        reg.register(KernelSpec(op, B.TORCH, "toy_kernels:slow"))
        reg.register(KernelSpec(op, B.TRITON, "toy_kernels:fast"))


    def late(op):  # a plug-in's backend, registered on every rank: when, each rank's clock says
        reg.register(KernelSpec(op, B.CUTE_DSL, "toy_kernels:fast"))


    registered = os.environ["INIT_FILE"] + ".registered"
    if rank == 0:  # toy.late_on_1: rank 0 registers before selecting, and decides with the new backend
        late("toy.late_on_1")
        toy_kernels.plant("toy.late_on_1", "triton", {})
        while not os.path.exists(registered):  # rank 0 decides once rank 1 has registered
            time.sleep(0.01)
    else:  # ...rank 1 while its selection waits for rank 0's table
        def register_while_waiting():
            while not state.process.agreements.flights:
                time.sleep(0.01)
            late("toy.late_on_1")
            open(registered, "w").close()

        threading.Thread(target=register_while_waiting).start()
    picks = [selector.select_kernel("toy.late_on_1").backend.value]
    if rank == 0:  # toy.late_on_0 and toy.late_get: rank 0 registers while it decides, rank 1 before selecting
        decide_here = tuning._decide_here

        def registering(op, *args, **kwargs):
            late(op)
            return decide_here(op, *args, **kwargs)

        tuning._decide_here = registering
        for op in ("toy.late_on_0", "toy.late_get"):
            toy_kernels.plant(op, "triton", {})
    else:
        late("toy.late_on_0")
        late("toy.late_get")
    picks.append(selector.select_kernel("toy.late_on_0").backend.value)
    # get_kernel's cache follows rank 0's word too: rank 1's own clock saw no registration during its lookup
    picks.append(selector.get_kernel("toy.late_get") is toy_kernels.fast)
    if rank == 0:
        tuning._decide_here = decide_here
        for op in ("toy.late_on_0", "toy.late_get"):
            toy_kernels.plant(op, "cute_dsl", {})  # what rank 0 decides with the new backend
    # Kept or dropped alike on every rank: a selection again is a collective on every rank or on none.
    picks.append(selector.get_kernel("toy.late_get") is toy_kernels.fast)
    picks += [selector.select_kernel(op).backend.value for op in ("toy.late_on_1", "toy.late_on_0", "toy.late_get")]
""") + PICKS_AND_ALL_REDUCE


def test_a_registration_during_the_first_agreement_is_kept_or_dropped_as_rank_0_says(tmp_path):
    # Used to hang: each rank kept or dropped the agreed table by its own clock, so a rank on which the
    # registration landed during the broadcast selected again, with a collective the other ranks did not make.
    results, _ = run_ranks(DURING, 2, tmp_path)
    # toy.late_on_1: kept (rank 0 decided with the new backend); toy.late_on_0 and toy.late_get: dropped
    # everywhere, decided again (toy.late_get through get_kernel, whose cache rank 1 kept by its own clock).
    assert [(r["picks"], r["all_reduce"]) for r in results] == [
        (["triton", "triton", True, True, "triton", "cute_dsl", "cute_dsl"], 2.0)] * 2


NESTED = textwrap.dedent("""
    import datetime, json, os
    import torch, torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition


    kept = {}


    def inner2():  # a composite keeping its second sub-op's kernel from its first call (rank 0's while it decides)
        if "inner2" not in kept:
            kept["inner2"] = selector.get_kernel("toy.inner2")
        return kept["inner2"]


    def outer_slow(x):  # a composite op's backend selecting its sub-op at its first call, as rank 0 checks it
        inner = selector.get_kernel("toy.inner")
        for _ in range(32):
            y = inner(inner2()(x))
        return y


    def outer_fast(x):
        return selector.get_kernel("toy.inner")(inner2()(x))


    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))  # a rank left waiting fails in 20 s
    toy_kernels.use_fresh_registry()
    reg = selector.registry
    reg.register(KernelSpec("toy.inner", B.TORCH, "toy_kernels:fast"))  # one usable: its package is not there
    reg.register(KernelSpec("toy.inner", B.FLASHINFER, "toy_kernels:fast", requires=("autosel_no_such_package",)))
    reg.register(KernelSpec("toy.inner2", B.TORCH, "toy_kernels:slow"))  # two usable: rank 0 decides it
    reg.register(KernelSpec("toy.inner2", B.TRITON, "toy_kernels:fast"))
    if rank == 0:
        toy_kernels.plant("toy.inner2", "triton", {})  # what it decides, nothing timed
    reg.register(KernelSpec("toy.outer", B.TORCH, "__main__:outer_slow"))
    reg.register(KernelSpec("toy.outer", B.TRITON, "__main__:outer_fast"))
    reg.define(OpDefinition("toy.outer", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    picks = [selector.select_kernel("toy.outer").backend.value]
    # toy.inner2 was agreed with toy.outer: rank 1's composite, at its first call, selects it with no collective
    # (rank 0's holds the kernel it chose while deciding, and makes none).
    picks.append((kept["inner2"] if rank == 0 else selector.get_kernel("toy.inner2")) is toy_kernels.fast)
    # toy.inner's own agreement, made now by every rank: sent with toy.outer's too
    picks.append(selector.get_kernel("toy.inner") is toy_kernels.fast)
""") + PICKS_AND_ALL_REDUCE


def test_an_op_selected_while_rank_0_decides_another_is_agreed_when_every_rank_selects_it(tmp_path):
    # Used to hang for good: rank 0, deciding toy.outer under the broadcast lock, selected toy.inner (a composite
    # backend's sub-op) with a broadcast of its own, under the same lock; rank 1 waited in toy.outer's broadcast.
    results, _ = run_ranks(NESTED, 2, tmp_path, AUTOSEL_BUDGET_S="2")
    assert results[0]["picks"] == results[1]["picks"]  # rank 1 runs rank 0's decision of toy.outer
    assert results[0]["picks"][0] in ("torch", "triton") and results[0]["picks"][1:] == [True, True]
    assert [r["all_reduce"] for r in results] == [2.0, 2.0]


def test_a_ranks_own_answer_is_looked_up_and_never_tuned(monkeypatch):
    reg = KernelRegistry()
    use_registry(monkeypatch, reg)
    use_platform(monkeypatch, platforms.PlatformInfo.detect())
    monkeypatch.syspath_prepend(str(HERE))
    import toy_kernels

    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    monkeypatch.setattr(autosel.tuner.Tuner, "tune_buckets", lambda *a, **k: pytest.fail("tuned"))
    eligible = reg.get("toy.double")
    platform = platforms.current_platform()
    assert tuning.stored_table("toy.double", eligible, platform, "eager", config.settings()) is None
    toy_kernels.plant("toy.double", "torch", {(16,): "triton"})
    assert tuning.stored_table("toy.double", eligible, platform, "eager", config.settings()) == BucketTable(
        "toy.double", "eager", "torch", {(16,): "triton"})


class FakeGroupOf2:
    """torch.distributed as rank 0 of 2 sees it, counting broadcasts; each takes a moment, as a real one does.
    during: called inside the next broadcast. received: what the other ranks' broadcast carries instead of
    rank 0's message (a rank other than 0 sees that)."""

    def __init__(self, rank: int = 0):
        self.rank, self.broadcasts, self.during, self.received = rank, 0, None, None
        self.group = type("group", (), {"WORLD": type("ProcessGroup", (), {})()})

    def world(self):
        return (self.rank, 2, self)

    def broadcast_object_list(self, message, src, group=None):
        import time

        self.broadcasts += 1
        if self.during is not None:
            self.during()
        if self.received is not None:
            message[0] = self.received
        time.sleep(0.2)


@pytest.fixture
def fake_world(monkeypatch):
    from autosel import distributed

    fake = FakeGroupOf2()
    monkeypatch.setattr(distributed, "_world", lambda: fake.world())
    monkeypatch.setattr(state.process.agreements, "agreed", {})
    monkeypatch.setattr(state.process.agreements, "flights", {})
    return fake


def test_threads_of_one_rank_agreeing_on_one_op_make_one_broadcast(fake_world):
    # Two threads of a rank could both broadcast where another rank made one: the ranks' collectives then differed.
    import threading

    from autosel import distributed

    answers = []
    threads = [threading.Thread(target=lambda: answers.append(distributed.agree(lambda: "triton", what="op",
                                                                                key=("toy.op", "eager"))))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (answers, fake_world.broadcasts) == (["triton"] * 4, 1)


def test_an_agreement_forgotten_while_rank_0_decides_is_not_kept_and_one_forgotten_while_sent_is(fake_world):
    from autosel import distributed

    def decide_and_forget():  # clear_cache() while rank 0 decides: the answer may predate it
        distributed.forget_agreements()
        return "torch"

    assert distributed.agree(decide_and_forget, what="op", key=("toy.op", "eager")) == "torch"
    assert distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager")) == "torch"
    assert fake_world.broadcasts == 2  # not kept: asked again, agreed again
    assert distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager")) == "torch"
    assert fake_world.broadcasts == 2  # kept this time
    # Once sent, kept on rank 0 too, as it told every rank: dropped on rank 0 alone, its next selection was a
    # collective the others did not make (a rank joining the broadcast seconds late held that window open).
    distributed.forget_agreements()
    fake_world.during = distributed.forget_agreements
    distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager"))
    fake_world.during = None
    distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager"))
    assert fake_world.broadcasts == 3


def test_forgetting_an_op_forgets_its_agreements_only_and_one_under_way(fake_world):
    # A registration for an op forgot get_kernel's kernels but not the table the ranks had agreed: it was served
    # again, without the new backend, until clear_cache().
    from autosel import distributed

    for key in (("toy.op", "eager"), ("toy.op", "graph"), ("toy.other", "eager")):
        distributed.agree(lambda: "torch", what="op", key=key)
    distributed.forget_agreements("toy.op")
    assert set(state.process.agreements.agreed) == {("toy.other", "eager")}
    def decide_while_registered():  # a registration for the op while rank 0 decides it
        distributed.forget_agreements("toy.op")
        return "triton"

    distributed.agree(decide_while_registered, what="op", key=("toy.op", "eager"))
    assert distributed.agree(lambda: "triton", what="op", key=("toy.op", "eager")) == "triton"
    assert fake_world.broadcasts == 3 + 2  # the one forgotten under way is asked again; toy.other never was


@pytest.mark.parametrize("kept, broadcasts", [(True, 1), (False, 2)])
def test_a_rank_keeps_an_answer_or_drops_it_as_rank_0_says(fake_world, kept, broadcasts):
    # A rank dropped an answer when a registration landed on it during the broadcast, whatever rank 0 did: it then
    # selected again with a collective rank 0 did not make.
    from autosel import distributed

    fake_world.rank, fake_world.received = 1, ("ok", "op", distributed._registrations(), "triton", kept, {})
    fake_world.during = lambda: distributed.forget_agreements("toy.op")  # registered here, during the broadcast
    assert distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager")) == "triton"
    fake_world.during = None
    distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager"))
    assert fake_world.broadcasts == broadcasts


def test_a_new_process_group_agrees_afresh(fake_world):
    # Keyed by id() of the group, a restarted group could reuse an old answer on one rank only.
    from autosel import distributed

    distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager"))
    fake_world.group.WORLD = type("ProcessGroup", (), {})()  # destroy_process_group, init_process_group
    distributed.agree(lambda: "torch", what="op", key=("toy.op", "eager"))
    assert fake_world.broadcasts == 2


def test_a_rank_that_receives_another_op_s_decision_raises_instead_of_running_it(fake_world):
    # Ranks selecting in different orders paired one op's broadcast with another's: a rank ran the wrong table.
    from autosel import distributed

    fake_world.rank = 1
    fake_world.received = ("ok", "op 'toy.other' (eager mode)", distributed._registrations(), "triton", True, {})
    with pytest.raises(TuningError, match=r"^op 'toy.op' \(eager mode\): rank 1 of 2 received rank 0's decision "
                                          r"for op 'toy.other' \(eager mode\) instead: the ranks select their "
                                          r"kernels in different orders"):
        distributed.agree(lambda: "torch", what="op 'toy.op' (eager mode)", key=("toy.op", "eager"))


def test_registrations_that_differ_from_rank_0s_are_named_in_the_mismatch_and_warned_of_before_it(
        fake_world, monkeypatch, caplog):
    # A plug-in installed on some ranks only gave an op two backends there and one elsewhere: the ranks with one
    # selected it alone, the others waited in its broadcast, which then paired with another op's (or hung), and the
    # error blamed the order of the selections.
    import logging

    from autosel import distributed

    reg = KernelRegistry()
    use_registry(monkeypatch, reg)
    monkeypatch.setattr(state.process.agreements, "gaps_warned", set())
    for op in ("toy.op", "toy.solo"):
        reg.register(KernelSpec(op, B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.op", B.TRITON, "toy_kernels:fast"))
    reg.register(KernelSpec("toy.solo", B.FLASHINFER, "plugin:solo"))  # the plug-in, on this rank only
    rank0 = {"toy.op": ("torch", "triton"), "toy.solo": ("torch",)}
    gap = "op 'toy.solo' (rank 0: torch; here: flashinfer, torch)"
    caplog.set_level(logging.WARNING, logger="autosel")
    fake_world.rank, fake_world.received = 1, ("ok", "op 'toy.op' (eager mode)", rank0, "triton", True, {})
    for _ in range(2):  # an agreement that pairs up: warned of once, and the answer run
        assert distributed.agree(lambda: "torch", what="op 'toy.op' (eager mode)", key=("toy.op", "eager")) == "triton"
        distributed.forget_agreements()
    assert [m for m in caplog.messages if "registers other backends" in m] == [
        f"rank 1 of 2 registers other backends than rank 0 for {gap}: a selection of such an op can leave the ranks "
        "waiting in different collectives until the process group's timeout, or running different kernels; install "
        "the same plug-ins on every rank and register their backends before selecting"]
    # This rank agrees on toy.solo, which rank 0 selected alone; rank 0's next agreement is another op's.
    with pytest.raises(TuningError) as raised:
        distributed.agree(lambda: "torch", what="op 'toy.solo' (eager mode)", key=("toy.solo", "eager"))
    assert str(raised.value) == (
        "op 'toy.solo' (eager mode): rank 1 of 2 received rank 0's decision for op 'toy.op' (eager mode) instead: the "
        f"ranks register other backends for {gap}, so a rank selected such an op alone (one backend registered "
        "there) or agreed on it alone; install the same plug-ins on every rank and register their backends before "
        "selecting")


def test_kernels_resolved_before_the_process_group_was_up_are_named_at_its_first_agreement(
        fake_world, monkeypatch, caplog):
    # get_kernel keeps what it resolved before init_process_group (this rank's own choice) and the warm path has
    # no collective: the ranks could run different kernels, silently.
    import logging

    from autosel import distributed, selector

    reg = KernelRegistry()
    use_registry(monkeypatch, reg)
    monkeypatch.syspath_prepend(str(HERE))
    import toy_kernels

    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    toy_kernels.plant("toy.double", "torch", {})
    world = distributed._world
    monkeypatch.setattr(distributed, "_world", lambda: None)  # before init_process_group
    selector.get_kernel("toy.double")
    assert state.process.agreements.chosen_alone == {"toy.double"}
    monkeypatch.setattr(distributed, "_world", world)
    caplog.set_level(logging.WARNING, logger="autosel")
    distributed.agree(lambda: "torch", what="op", key=("toy.other", "eager"))
    assert ("rank 0 of 2: get_kernel resolved 'toy.double' before the process group was up, from this rank's own "
            "decisions, and keeps them") in " ".join(caplog.messages)
    selector.clear_cache()
    assert not state.process.agreements.chosen_alone


def test_set_group_takes_a_process_group_or_none():
    # A list of ranks was taken, and every rank's next selection failed in torch ("'list' object has no attribute").
    from autosel import distributed

    with pytest.raises(TypeError, match=r"^set_group takes a torch.distributed process group "
                                        r"\(dist.new_group\(\[...\]\)\) or None, got \[0, 1\]$"):
        distributed.set_group([0, 1])
    distributed.set_group(None)


def test_what_rank_0_selects_while_it_decides_is_cached_for_that_decision_only(fake_world, monkeypatch):
    # Neither agreed nor kept past the decision, a sub-op selected on every call of a timed backend was selected
    # again each time (60-130 us a call added to what rank 0 timed).
    from autosel import distributed, selector

    builds = []
    monkeypatch.setattr(state.process.kernels, "kernels", {})
    monkeypatch.setattr(selector, "_build", lambda *key: builds.append(key) or (lambda: key))

    def decide():
        assert selector.get_kernel("toy.sub") is selector.get_kernel("toy.sub")
        return "torch"

    distributed.agree(decide, what="op", key=("toy.op", "eager"))
    assert builds == [("toy.sub", None, None)] and state.process.kernels.kernels == {}
    assert not distributed.deciding()


def test_what_rank_0_decides_while_deciding_another_op_is_sent_and_agreed_with_it(fake_world):
    # A composite backend that keeps the kernel it selected while rank 0 timed it never selects again there; the
    # other ranks' first selection of that sub-op was then a broadcast rank 0 never made.
    from autosel import distributed

    distributed.agree(lambda: "torch", what="op", key=("toy.agreed", "eager"))

    def decide():
        assert distributed.agree(lambda: "triton", what="sub", key=("toy.sub", "eager")) == "triton"
        # one agreed already is looked up, not decided again here
        assert distributed.agree(lambda: "local", what="sub", key=("toy.agreed", "eager")) == "torch"
        return "torch"

    distributed.agree(decide, what="op", key=("toy.op", "eager"))
    assert state.process.agreements.agreed[("toy.sub", "eager")] == "triton" and fake_world.broadcasts == 2
    assert distributed.agreement_kept() is True


def test_a_sub_op_forgotten_while_rank_0_decides_is_not_sent(fake_world):
    from autosel import distributed

    def decide():
        distributed.agree(lambda: "triton", what="sub", key=("toy.sub", "eager"))
        distributed.forget_agreements("toy.sub")  # registered for the sub-op while rank 0 decides
        return "torch"

    distributed.agree(decide, what="op", key=("toy.op", "eager"))
    agreed = state.process.agreements.agreed
    assert ("toy.sub", "eager") not in agreed and ("toy.op", "eager") in agreed
