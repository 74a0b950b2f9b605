"""Many ranks, one decision: with a process group up, every rank runs rank 0's winner (gloo on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent

RANK = textwrap.dedent("""
    import json, os
    import torch.distributed as dist
    import toy_kernels
    from autosel import selector
    from autosel.spec import KernelSpec, KernelBackend as B, OpDefinition

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="file://" + os.environ["INIT_FILE"], rank=rank, world_size=2)
    timed = toy_kernels.use_fresh_registry()
    reg = selector.registry
    reg.register(KernelSpec("toy.missing_shapes", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.missing_shapes", B.TRITON, "toy_kernels:fast"))
    if rank == 1:  # alone, with tuning off and an empty DB, this rank would raise "multiple backends"
        os.environ["AUTOSEL_TUNE"] = "off"
    winner = selector.select_kernel("toy.double").backend.value
    try:
        selector.select_kernel("toy.missing_shapes")
        error = None
    except ValueError as exc:
        error = str(exc)
    reg.register(KernelSpec("toy.split", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.split", B.TRITON, "toy_kernels:overhead"))
    reg.define(OpDefinition("toy.split", shapes=toy_kernels.SPLIT_SHAPES, make_inputs=toy_kernels.inputs,
                            bucket=toy_kernels.bucket))
    table = selector.get_kernel("toy.split").table
    reg.register(KernelSpec("toy.broken", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.broken", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.broken", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.broken_inputs))
    try:
        selector.select_kernel("toy.broken")
        broken = None
    except Exception as exc:
        broken = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"rank": rank, "winner": winner, "timed": len(timed), "error": error,
                      "table": sorted([list(k), w] for k, w in table.winners.items()), "broken": broken}))
    dist.destroy_process_group()
""")


def test_every_rank_runs_rank_zeros_winner_and_gets_its_errors(tmp_path):
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), INIT_FILE=str(tmp_path / "init"), PYTHONPATH=str(HERE),
                   AUTOSEL_DB=str(tmp_path / f"rank{rank}.db"))
        procs.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    # rank 0 tuned toy.double, toy.split and toy.broken; rank 1 none of them
    assert [(r["rank"], r["winner"], r["timed"]) for r in results] == [(0, "triton", 3), (1, "triton", 0)]
    assert results[0]["error"].startswith("op 'toy.missing_shapes' has multiple backends usable")
    assert results[1]["error"] == results[0]["error"] + " (decided on rank 0 of 2)"
    # The whole bucket table is rank 0's: rank 1, with tuning off and an empty DB, dispatches alike.
    assert results[0]["table"] == results[1]["table"] == [[[16], "torch"], [[1 << 20], "triton"]]
    # Used to hang: a RuntimeError on rank 0 was raised before the broadcast, rank 1 waited forever.
    broken = "op 'toy.broken': its make_inputs raised RuntimeError: input factory failed (simulated) for the shape"
    assert results[0]["broken"].startswith(f"TuningError: {broken}")
    assert results[1]["broken"].startswith(f"TuningError: op 'toy.broken' (eager mode): rank 0 failed with "
                                           f"TuningError: {broken}")
