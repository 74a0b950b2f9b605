"""autosel.bench.model (`autosel bench model`) on a tiny Llama on the CPU: a row per variant, every variant's timed
step matches transformers', forced variants run the forced backend, and forcing does not leak into the measured
variant; tools/hf_check.py beside it."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")
TOOLS = Path(__file__).parent.parent / "tools"
OPS = ("layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "embeddings.rope", "activation.silu_and_mul")


@pytest.fixture
def model_bench():
    return importlib.import_module("autosel.bench.model")


def store(winner: str) -> None:
    """An eager op-level decision for each op the patch calls, as `autosel tune` stores one (evidence trimmed)."""
    from autosel import tuning
    from autosel.decisions import CandidateResult, Decision
    from autosel.platforms import current_platform, version_vector
    from autosel.registry import registry

    platform = current_platform()
    for op in OPS:
        eligible = [s for s in registry.get(op) if s.is_available(platform)]
        tuning.database().record(Decision(
            op=op, mode="eager", bucket="*", winner=winner, platform_key=platform.key,
            versions=version_vector(platform, eligible), margin=0.03, method="stored",
            candidates=tuple(CandidateResult(s.backend.value, "ok", score=1.0) for s in eligible),
            created_at="2026-01-01T00:00:00+00:00"), [])


def test_tiny_run_has_a_row_per_variant_matching_transformers(model_bench, tmp_path):
    store("torch")  # the measured variant reads it; nothing is tuned
    plan = model_bench.Plan(model="tiny-llama", layers=2, device="cpu", dtype="bfloat16", prefill_tokens=(8,),
                         decode_batches=(2,), kv=8, backends=("torch", "triton", "flashinfer"), rounds=2, block_ms=1)
    result = model_bench.bench(plan)
    for phase, data in result["phases"].items():
        assert list(data["variants"]) == ["transformers", "autosel", "torch", "triton", "flashinfer"]
        for name in ("autosel", "torch"):
            assert data["variants"][name]["resolved"] == {op: ["torch"] for op in OPS}
        for name in ("triton", "flashinfer"):
            assert data["variants"][name]["skipped"].startswith(f"layernorm.rmsnorm's {name} kernel cannot run here: "
                                                                "needs cuda, device is cpu")
        [size] = data["sizes"]
        assert sorted(size["results"]) == ["autosel", "torch", "transformers"]
        assert all(r["matches"] and len(r["rounds_ms"]) == 2 for r in size["results"].values())
        assert size["best_fixed"] == "torch" and size["results"]["torch"]["ratio_to_best_fixed"] == 1.0
    assert [(d["op"], d["layer"], d["winner"], d["tuned_by_this_run"]) for d in result["decisions"]] == [
        (op, "user", "torch", False) for op in sorted(OPS)]
    text = model_bench.report(result)
    assert text.count("| flashinfer | - | - | - | - | skipped: layernorm.rmsnorm's flashinfer kernel") == 2
    assert "| rmsnorm torch, fused_add_rmsnorm torch, rope torch, silu_and_mul torch |" in text
    if importlib.util.find_spec("matplotlib") is not None:
        model_bench.plot(result, tmp_path / "step.png")
        assert (tmp_path / "step.png").stat().st_size > 0
    [prefill, decode] = model_bench.tables(result)
    assert [row[0] for row in prefill["rows"]] == ["transformers", "autosel", "torch", "triton", "flashinfer"]
    assert prefill["rows"][-1] == ["flashinfer", "-"] and decode["columns"] == ["variant", "batch 2"]


def test_graph_from_tokens_adds_autosel_on_the_eager_decisions_and_a_variant_can_run_twice(model_bench):
    store("torch")
    plan = model_bench.Plan(model="tiny-llama", layers=1, device="cpu", dtype="bfloat16", prefill_tokens=(8,),
                         decode_batches=(2,), kv=8, backends=("torch", "torch#2", "autosel#2"), rounds=2, block_ms=1,
                         graph_from_tokens=4)
    assert plan.fixed == ("torch", "torch#2")
    phases = model_bench.bench(plan)["phases"]
    assert list(phases["prefill"]["variants"]) == ["transformers", "autosel", "autosel-eager", "torch", "torch#2",
                                                   "autosel#2"]
    prefill, decode = phases["prefill"]["variants"], phases["decode"]["variants"]
    assert all(prefill[name]["resolved"] == {op: ["torch"] for op in OPS}
               for name in ("autosel", "autosel-eager", "torch#2", "autosel#2"))
    assert decode["autosel-eager"]["skipped"].startswith("the same as autosel here")
    [size] = phases["prefill"]["sizes"]
    assert size["best_fixed"] in ("torch", "torch#2") and size["results"]["autosel-eager"]["matches"]


def test_forcing_one_variant_does_not_leak_into_the_next(model_bench, monkeypatch):
    # get_kernel's cache is keyed by its arguments, not by AUTOSEL_BACKEND: without clearing it around each
    # patch, the variant patched after a forced one got the forced kernels (and the reverse).
    from autosel.platforms import current_platform
    from autosel.bench.models import build

    store("torch_compile")  # resolved, never called here: nothing compiles
    monkeypatch.setenv("AUTOSEL_BACKEND", "torch")  # a force set outside the tool: the measured variant ignores it
    model, platform = build("tiny-llama", 1, "cpu", torch.float32), current_platform()
    resolved = []
    for name in ("autosel", "torch", "autosel"):
        patched = model_bench.patch_variant(name, model, mode="eager", projections=False, platform=platform)
        resolved.append(set(b for backends in patched.resolved.values() for b in backends))
        patched.handle.undo()
    assert resolved == [{"torch_compile"}, {"torch"}, {"torch_compile"}]
    import os
    assert os.environ["AUTOSEL_BACKEND"] == "torch"
    # A backend an op lacks is refused before patching, with the op named (a global force would fall back).
    assert model_bench.cannot_force("flashinfer", ["gemm.mm"], platform) == "gemm.mm has no flashinfer kernel"


def test_a_variant_can_force_one_op_and_keep_autosels_decisions_for_the_rest(model_bench):
    # "autosel:OP=BACKEND": what autosel adds at one op over hard-coding that op's backend, in a whole step.
    from autosel.platforms import current_platform
    from autosel.bench.models import build

    store("torch_compile")  # resolved, never called here: nothing compiles
    model, platform = build("tiny-llama", 1, "cpu", torch.float32), current_platform()
    patched = model_bench.patch_variant("autosel:layernorm.rmsnorm=torch", model, mode="eager", projections=False,
                                     platform=platform)
    patched.handle.undo()
    assert patched.resolved == {op: ["torch" if op == "layernorm.rmsnorm" else "torch_compile"] for op in OPS}
    skipped = model_bench.patch_variant("autosel:gemm.mm=torch", model, mode="eager", projections=False,
                                     platform=platform)
    assert skipped.handle is None and "needs --projections" in skipped.skipped
    missing = model_bench.patch_variant("autosel:gemm.mm=flashinfer", model, mode="eager", projections=True,
                                     platform=platform)
    assert missing.skipped == "gemm.mm has no flashinfer kernel"
    plan = model_bench.Plan(model="tiny-llama", layers=1, device="cpu", dtype="bfloat16", prefill_tokens=(8,),
                         decode_batches=(2,), kv=8, backends=("torch", "autosel:gemm.mm=torch"), rounds=1,
                         block_ms=1)
    assert plan.fixed == ("torch",)  # forcing one op is not a fixed backend


def test_a_variant_whose_step_fails_is_a_row_and_the_others_are_still_timed(model_bench, monkeypatch, tmp_path):
    # On the H200 one variant's failed capture or kernel must not lose the other variants' figures.
    store("torch")
    real = model_bench.prefill_step

    def failing_when_patched(model, ids):
        if getattr(model, "_autosel_patch", None) is None:
            return real(model, ids)
        return lambda: (_ for _ in ()).throw(RuntimeError("boom"))

    monkeypatch.setattr(model_bench, "prefill_step", failing_when_patched)
    plan = model_bench.Plan(model="tiny-llama", layers=1, device="cpu", dtype="bfloat16", prefill_tokens=(8,),
                         decode_batches=(2,), kv=8, backends=("torch",), rounds=2, block_ms=1)
    result = model_bench.bench(plan)
    [prefill] = result["phases"]["prefill"]["sizes"]
    assert prefill["results"]["torch"] == {"failed": "RuntimeError: boom"} == prefill["results"]["autosel"]
    assert prefill["best_fixed"] is None and prefill["results"]["transformers"]["speedup_vs_transformers"] == 1.0
    [decode] = result["phases"]["decode"]["sizes"]
    assert decode["best_fixed"] == "torch" and all(r["matches"] for r in decode["results"].values())
    assert "| torch | failed | - | - | - | rmsnorm torch, fused_add_rmsnorm torch, rope torch, silu_and_mul torch; " \
           "failed at 8 tokens: RuntimeError: boom |" in model_bench.report(result)


def test_a_variant_keeps_its_colour_in_every_phase_of_the_plot(model_bench):
    # autosel-eager, skipped in decode, used to shift every later variant's colour in the decode panel.
    phases = {"prefill": {"variants": ["transformers", "autosel", "autosel-eager", "triton"]},
              "decode": {"variants": ["transformers", "autosel", "triton"]}}
    colors = model_bench.variant_colors(phases, ["c0", "c1", "c2", "c3"])
    assert colors == {"transformers": "c0", "autosel": "c1", "autosel-eager": "c2", "triton": "c3"}


@pytest.mark.compile
def test_compile_runs_every_variants_step_compiled_and_still_matching_transformers(model_bench, tmp_path):
    store("torch")
    plan = model_bench.Plan(model="tiny-llama", layers=1, device="cpu", dtype="bfloat16", prefill_tokens=(8,),
                         decode_batches=(2,), kv=8, backends=(), rounds=1, block_ms=1, compile=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    result = model_bench.bench(plan)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 4  # two variants, two phases
    for data in result["phases"].values():
        [size] = data["sizes"]
        assert sorted(size["results"]) == ["autosel", "transformers"]
        assert all(r["matches"] for r in size["results"].values())
    assert model_bench.report(result).count(", every variant under torch.compile") == 2


@pytest.mark.parametrize("args, said", [
    (["--backends", "triton,nosuch,torch#2,autosel#2"], "--backends: unknown nosuch; known: torch, torch_compile, "),
    (["--backends", "autosel:gemm.mm=torch,autosel:gemm.mm=nosuch"], "--backends: unknown autosel:gemm.mm=nosuch;"),
    (["--rounds", "0"], "Invalid value for '--rounds': 0 is not in the range x>=1."),
    (["--kv", "0"], "Invalid value for '--kv': 0 is not in the range x>=1."),
    (["--block-ms", "0"], "Invalid value for '--block-ms': 0.0 is not in the range x>0."),
    (["--prefill-tokens", "8,x"], "'8,x': give whole numbers separated by commas"),
    (["--plot-from", "nosuch.json"], "File 'nosuch.json' does not exist."),
])
def test_bench_model_refuses_a_usage_mistake_before_it_runs(model_bench, monkeypatch, tmp_path, args, said):
    # Used to break: a misspelt backend ran the whole benchmark, 0 rounds (or kv, block-ms) ran the default, and a
    # missing --plot-from file was a FileNotFoundError traceback.
    from click.testing import CliRunner

    from autosel.cli import main

    monkeypatch.setattr(model_bench, "bench", lambda plan: pytest.fail("ran"))
    result = CliRunner().invoke(main, ["bench", "model", "--tiny", "--device", "cpu", "--results", str(tmp_path),
                                       *args])
    assert result.exit_code in (1, 2) and said in result.output and not list(tmp_path.iterdir())


def test_hf_check_help_gives_the_whole_description(monkeypatch, capsys):
    # Used to break: --help showed the docstring's first line, which stops mid-sentence.
    monkeypatch.syspath_prepend(str(TOOLS))
    module = importlib.import_module("hf_check")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    assert module.__doc__.split("\n\n")[0] in capsys.readouterr().out


@pytest.mark.parametrize("args, code, said", [
    (["--backend", "nosuch"], 2, "--backend: unknown kernel backend 'nosuch'; known backends: torch, "),
    (["--backend", "triton"], 1, "tiny-llama: backend='triton' cannot run layernorm.rmsnorm on this machine"),
])
def test_hf_check_says_in_one_line_why_a_backend_cannot_run(monkeypatch, tmp_path, capsys, args, code, said):
    # Used to break: a ValueError (unknown backend) or IntegrationError (triton on a CPU) traceback.
    monkeypatch.syspath_prepend(str(TOOLS))
    hf_check = importlib.import_module("hf_check")
    with pytest.raises(SystemExit) as exit_:
        hf_check.main(["--model", "tiny-llama", "--layers", "1", "--tokens", "4", "--new-tokens", "1",
                       "--device", "cpu", "--out", str(tmp_path), *args])
    if code == 2:
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    else:  # raise SystemExit(message): exit status 1
        assert exit_.value.code.startswith(said)


@pytest.mark.parametrize("name, q_heads, intermediate", [("llama-3-70b-tp8", 64 // 8, 28672 // 8),
                                                          ("qwen2.5-32b-tp8", 40 // 8, 27648 // 8)])
def test_a_tensor_parallel_rank_model_has_its_share_of_heads_and_intermediate(model_bench, name, q_heads, intermediate):
    # The model step on one rank's share: without head_dim given, transformers would make Qwen2's heads
    # hidden / heads = 1024 wide, and the rope and attention shapes would be no rank's.
    from autosel.bench.models import build

    layer = build(name, 1, "meta", torch.bfloat16).model.layers[0]
    assert layer.self_attn.q_proj.out_features == q_heads * 128 and layer.self_attn.k_proj.out_features == 128
    assert layer.mlp.gate_proj.out_features == intermediate and layer.self_attn.o_proj.in_features == q_heads * 128
