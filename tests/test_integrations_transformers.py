"""autosel.integrations.transformers on tiny random models: the patched model matches transformers (logits, greedy
tokens), counts what it patched, undoes itself exactly, and refuses a structure it was not written for."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import autosel
from autosel.errors import IntegrationError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")
transformers = patch_model = WRITTEN_FOR = None  # imported by the fixture below


@pytest.fixture(autouse=True, scope="module")
def imported_when_run():
    # Imported at collection, transformers imported torch._dynamo and with it triton, whose @triton.jit library
    # then took compiled mode before tests/test_triton_kernels.py imported its kernels under TRITON_INTERPRET=1.
    global transformers, patch_model, WRITTEN_FOR
    from autosel.integrations import transformers as integration
    # The transformers module the integration reads (its version, above all): transformers 5.24's first access
    # to a model class (transformers.LlamaForCausalLM) puts a new module object in sys.modules, so after another
    # test file had built a model, `import transformers` here gave an object the integration never reads, and
    # the version test's monkeypatch did not reach patch_model.
    transformers, patch_model, WRITTEN_FOR = integration.transformers, integration.patch_model, integration.WRITTEN_FOR

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def tiny(family: str, dtype=torch.float32, **overrides):
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[family])
    settings = dict(vocab_size=128, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                    num_attention_heads=6, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return model_class(config_class(**(settings | overrides))).to(dtype).eval()


def batch():
    """Two prompts, the second left-padded, so that positions come from the attention mask."""
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


def logits(model):
    ids, mask = batch()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def replaced_forwards(model) -> list[str]:
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("projections", [False, True])
def test_patched_logits_match_transformers(family, dtype, projections):
    model = tiny(family, dtype)
    expected = logits(model)
    with patch_model(model, backend="torch", projections=projections):
        got = logits(model)
    torch.testing.assert_close(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generation_gives_the_same_tokens(family):
    # float32: in bf16 a random model's near-tied logits can flip a greedy token within tolerance.
    model = tiny(family)
    ids, mask = batch()
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(**settings)
        with patch_model(model, backend="torch", projections=True):
            got = model.generate(**settings)
    assert got.shape == (2, 12 + 5)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("family, cache_implementation, overrides", [
    ("llama", None, {}), ("llama", "static", {}), ("qwen3", None, {}),
    ("mistral", None, dict(sliding_window=8)), ("mistral", "static", dict(sliding_window=8)),
])
def test_positions_past_max_position_embeddings_match_transformers(family, cache_implementation, overrides):
    # The rope table ended at max_position_embeddings and a longer call read past it: an IndexError with the torch
    # kernel, the whole process aborted with the torch.compile'd one, out-of-bounds reads on a GPU.
    model = tiny(family, max_position_embeddings=16, **overrides)
    ids, mask = batch()
    long_ids, long_mask = torch.cat((ids, ids), dim=1), torch.cat((mask, mask), dim=1)  # 24 tokens
    settings = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                    cache_implementation=cache_implementation)  # positions up to 19
    with torch.no_grad():
        expected = model(input_ids=long_ids, attention_mask=long_mask).logits
        expected_tokens = model.generate(**settings)
        with patch_model(model, backend="torch"):  # generate first: the table grows from the cache's length
            tokens = model.generate(**settings)
        with patch_model(model, backend="torch"):
            got = model(input_ids=long_ids, attention_mask=long_mask).logits
    torch.testing.assert_close(got, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])
    assert tokens.shape == (2, 12 + 8)
    assert torch.equal(tokens, expected_tokens)


@pytest.mark.compile
def test_a_call_past_the_rope_table_in_compiled_code_builds_its_rows_and_stores_none():
    # Stored from compiled code, a grown table lived in the CUDA graphs' memory under mode="reduce-overhead" and
    # the next replay overwrote it (tests/gpu/test_transformers_gpu.py); fullgraph=True: no graph break for it.
    from autosel.integrations.transformers import RopeTable

    inv_freq = torch.arange(1, 5, dtype=torch.float32) / 8
    table, expected = RopeTable(inv_freq, 1.0, 16), RopeTable(inv_freq, 1.0, 64).table
    step = torch.compile(lambda positions, bound: table.covering(bound).index_select(0, positions), fullgraph=True)
    for bound in (8, 40, 8):
        torch.testing.assert_close(step(torch.arange(bound), bound), expected[:bound], rtol=1e-5, atol=1e-5)
    assert table.table.shape[0] == 16 and not table.retired
    assert table.covering(40).shape[0] == 40 and table.retired  # eager calls grow the stored table
    torch.testing.assert_close(table.table, expected[:40], rtol=1e-5, atol=1e-5)


@pytest.mark.compile
def test_a_patched_model_compiles_with_fullgraph_and_gives_transformers_logits():
    # autosel's torch_compile kernels are functions torch.compile made, which an outer compile does not trace (a
    # graph break: fullgraph=True failed); compiled code calls them as custom ops (autosel.ops.opaque).
    model = tiny("llama")
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        ids = {tokens: torch.arange(tokens).remainder(128)[None] for tokens in (5, 9, 40, 3)}
        expected = {tokens: model(input_ids=x).logits for tokens, x in ids.items()}
        with patch_model(model, backend="torch_compile", projections=True):
            step = torch.compile(lambda x: model(input_ids=x).logits, backend=count, fullgraph=True)
            for tokens, x in ids.items():
                torch.testing.assert_close(step(x), expected[tokens], atol=1e-4, rtol=1e-4)
    assert len(graphs) <= 2  # the first length with constant sizes, then one for every other


@pytest.mark.parametrize("family, fuse, projections, counts", [
    # rmsnorm: input_layernorm per layer (+ post_attention_layernorm unfused, + q_norm and k_norm in Qwen3) + final
    ("llama", True, False, dict(rmsnorm=3, fused_add_rmsnorm=2, rope=2, silu_and_mul=2, gemm=0)),
    ("llama", False, True, dict(rmsnorm=5, fused_add_rmsnorm=0, rope=2, silu_and_mul=2, gemm=13)),
    ("qwen3", True, True, dict(rmsnorm=7, fused_add_rmsnorm=2, rope=2, silu_and_mul=2, gemm=13)),
    ("mistral", True, False, dict(rmsnorm=3, fused_add_rmsnorm=2, rope=2, silu_and_mul=2, gemm=0)),
    ("qwen2", True, True, dict(rmsnorm=3, fused_add_rmsnorm=2, rope=2, silu_and_mul=2, gemm=13)),
])
def test_counts_per_kind(family, fuse, projections, counts):
    # gemm: q, k, v, o, [gate; up] and down per layer, and lm_head.
    with patch_model(tiny(family), backend="torch", fuse=fuse, projections=projections) as patched:
        assert patched.counts == counts
        assert patched.skipped == ({} if projections else {"gemm": "projections=False"})
        assert str(patched).startswith(f"autosel patched {FAMILIES[family][1]} (transformers "
                                       f"{transformers.__version__}, mode eager): rmsnorm {counts['rmsnorm']}, ")


def test_forwards_call_the_kernels_resolved_at_patch_time_in_the_mode_given(monkeypatch):
    # The design point for CUDA graphs: no get_kernel (no selection, no capture check) per forward.
    asked, calls = [], {}
    real = autosel.get_kernel

    def counting(op, backend=None, *, mode=None):
        asked.append((op, backend, mode))
        kernel = real(op, backend)

        def run(*args):
            calls[op] = calls.get(op, 0) + 1
            return kernel(*args)
        return run

    monkeypatch.setattr(autosel, "get_kernel", counting)
    model = tiny("qwen3")
    with patch_model(model, backend="torch", mode="graph", projections=True) as patched:
        logits(model)
    ops = ("layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "embeddings.rope", "activation.silu_and_mul", "gemm.mm")
    assert sorted(asked) == sorted((op, "torch", "graph") for op in ops)
    assert sorted(patched.kernels) == sorted(ops)  # what autosel.bench.model reads the resolved backends from
    assert calls == {"layernorm.rmsnorm": 7, "layernorm.fused_add_rmsnorm": 2, "embeddings.rope": 2,
                     "activation.silu_and_mul": 2, "gemm.mm": 13}


def test_graph_from_tokens_runs_the_graph_decisions_on_long_calls_and_the_eager_ones_on_short(monkeypatch):
    real, calls = autosel.get_kernel, {}

    def per_mode(op, backend=None, *, mode=None):
        kernel = real(op, backend)

        def run(*args):
            calls[op, mode] = calls.get((op, mode), 0) + 1
            return kernel(*args)
        return run

    monkeypatch.setattr(autosel, "get_kernel", per_mode)
    model = tiny("llama")
    expected = logits(model)  # 2 x 12 = 24 tokens
    with patch_model(model, backend="torch", mode="eager", graph_from_tokens=24) as patched:
        assert patched.kernels["layernorm.rmsnorm"].parts[2] == 24
        torch.testing.assert_close(logits(model), expected, rtol=TOLERANCE[torch.float32], atol=1e-4)
        assert {mode for _, mode in calls} == {"graph"}
        calls.clear()
        with torch.no_grad():
            model(input_ids=batch()[0][:1, :11])  # 11 tokens
        assert {mode for _, mode in calls} == {"eager"}
        assert calls["activation.silu_and_mul", "eager"] == 2  # one per layer


def test_graph_from_tokens_is_the_kernel_itself_where_both_modes_resolve_alike():
    model = tiny("llama")
    with patch_model(model, backend="torch", graph_from_tokens=8) as patched:  # a forced backend: one kernel
        assert not hasattr(patched.kernels["layernorm.rmsnorm"], "parts")
    for mode, tokens in (("graph", 8), ("eager", 0), ("eager", 2.5)):
        with pytest.raises(ValueError, match="only in eager mode"):
            patch_model(model, mode=mode, graph_from_tokens=tokens)


def test_undo_restores_the_exact_original_model():
    model = tiny("qwen3", torch.bfloat16)
    before = logits(model)
    mlp = model.model.layers[0].mlp
    handle = patch_model(model, backend="torch", projections=True)
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    assert len(replaced_forwards(model)) == sum(handle.counts.values()) - 2  # gate/up is counted, not a module
    handle.undo()
    handle.undo()  # a second undo does nothing
    assert replaced_forwards(model) == [] and not hasattr(model, "_autosel_patch")
    assert mlp.gate_proj.weight.untyped_storage().data_ptr() != mlp.up_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(logits(model), before)
    patch_model(model, backend="torch").undo()  # patching again after an undo works


def test_undo_keeps_a_forward_someone_else_set_on_the_instance():
    # accelerate's hooks, for example, set module.forward on the instance.
    model = tiny("llama")
    norm = model.model.norm
    theirs = norm.forward
    norm.forward = theirs
    with patch_model(model, backend="torch"):
        assert norm.forward is not theirs
    assert norm.__dict__["forward"] is theirs


def test_patching_twice_or_with_a_bad_mode_raises():
    model = tiny("llama")
    with patch_model(model, backend="torch"):
        with pytest.raises(IntegrationError, match="already patched by autosel; call undo()"):
            patch_model(model, backend="torch")
    with pytest.raises(ValueError, match="mode='fast' is not valid; allowed values: eager, graph"):
        patch_model(model, mode="fast")


def test_an_explicit_backend_that_cannot_run_here_fails_at_patch_time_and_leaves_the_model_unchanged():
    # It patched, and the first forward failed far from its cause ("Torch not compiled with CUDA enabled").
    model = tiny("llama")
    before = replaced_forwards(model)
    with pytest.raises(IntegrationError, match=r"^backend='triton' cannot run layernorm.rmsnorm on this machine "
                                               r"\(needs cuda, device is cpu"):
        patch_model(model, backend="triton")
    assert replaced_forwards(model) == before and getattr(model, "_autosel_patch", None) is None


def test_dynamic_rope_is_left_to_transformers_and_said_so():
    model = tiny("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    expected = logits(model)
    with pytest.warns(UserWarning, match="autosel left rope to transformers: rope_type 'dynamic' changes"):
        patched = patch_model(model, backend="torch")
    assert patched.counts["rope"] == 0 and "rope" in patched.skipped
    torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=1e-4)
    patched.undo()


def test_another_transformers_release_with_the_same_structure_patches_with_a_warning(monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.31.0")
    with pytest.warns(UserWarning, match=f"written for transformers {WRITTEN_FOR}; transformers 5.31.0 has the "
                                         "structure it checks, but compare"):
        patch_model(tiny("llama"), backend="torch").undo()


def test_a_non_silu_mlp_is_left_to_transformers_and_said_so():
    model = tiny("llama", hidden_act="gelu")
    expected = logits(model)
    with pytest.warns(UserWarning, match="autosel left silu_and_mul to transformers: the MLP's activation is "
                                         "GELUActivation, not SiLU"):
        with patch_model(model, backend="torch") as patched:
            assert patched.counts["silu_and_mul"] == 0 and patched.counts["rope"] == 2
            torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=1e-4)


def _without_input_layernorm(model):
    del model.model.layers[1].input_layernorm


def _with_an_unknown_norm(model):
    model.model.layers[0].extra_norm = type(model.model.norm)(96)


def _attention_forward_renamed(model, monkeypatch):
    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        raise AssertionError("not called")
    monkeypatch.setattr(type(model.model.layers[0].self_attn), "forward", forward)


@pytest.mark.parametrize("change, message", [
    (_without_input_layernorm, "LlamaDecoderLayer has no input_layernorm"),
    (_with_an_unknown_norm, "RMSNorm modules this integration does not route: model.layers.0.extra_norm"),
    (_attention_forward_renamed, "LlamaAttention.forward takes (hidden_states, position_embeddings, "
                                 "attention_mask, past_key_values), expected (hidden_states, position_embeddings, "
                                 "attention_mask, cache)"),
])
def test_a_structure_it_was_not_written_for_fails_loudly_and_leaves_the_model_unchanged(change, message, monkeypatch):
    model = tiny("llama")
    if change is _attention_forward_renamed:
        change(model, monkeypatch)
    else:
        change(model)
    with pytest.raises(IntegrationError) as failure:
        patch_model(model, backend="torch")
    # With the version it was written for, the model itself differs: it said to install the version installed.
    assert str(failure.value).startswith("the llama model is not what autosel.integrations.transformers replaces: ")
    assert "install" not in str(failure.value)
    assert message in str(failure.value)
    assert replaced_forwards(model) == [] and not hasattr(model, "_autosel_patch")
    monkeypatch.setattr(transformers, "__version__", "5.99.0")  # another release: its structure may have moved
    with pytest.raises(IntegrationError, match=f"written for transformers {WRITTEN_FOR}; with transformers 5.99.0 .* "
                                               f"install transformers=={WRITTEN_FOR}"):
        patch_model(model, backend="torch")


def test_an_unsupported_family_fails_loudly():
    config = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=2, n_positions=64)
    with pytest.raises(IntegrationError, match="has model_type 'gpt2'; autosel.integrations.transformers patches "
                                               "llama, mistral, qwen2, qwen3 models only"):
        patch_model(transformers.GPT2LMHeadModel(config), backend="torch")


@pytest.mark.compile
def test_real_selection_on_a_tiny_model(monkeypatch):
    # No backend given: rmsnorm and silu_and_mul are tuned (torch against torch_compile) as in an engine; the
    # other two are forced as a user would force them, which keeps the test near 30 s rather than 60.
    monkeypatch.setenv("AUTOSEL_BACKEND", "layernorm.fused_add_rmsnorm=torch,embeddings.rope=torch")
    model = tiny("llama", torch.bfloat16)
    expected = logits(model)
    with patch_model(model) as patched:
        got = logits(model)
    assert patched.counts["rope"] == 2 and patched.counts["fused_add_rmsnorm"] == 2
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.compile
def test_readme_section_runs_as_pasted(tmp_path):
    # No backend given, so the shipped DB (or a tune) decides and torch_compile kernels may compile: ~15 s.
    from conftest import run_snippet

    result = run_snippet("README.md", "## Use it with transformers", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("autosel patched LlamaForCausalLM (transformers ")
    assert "rmsnorm 3, fused_add_rmsnorm 2, rope 2, silu_and_mul 2" in result.stdout


def test_a_deep_copy_of_a_patched_model_is_refused_and_a_copy_made_after_undo_works():
    # The copy's forwards were the original's closures: it ran the original's weights, and its handle undid the
    # original.
    import copy

    model = tiny("llama")
    expected = logits(model)
    with patch_model(model, backend="torch"):
        with pytest.raises(IntegrationError, match="a deep copy of it would run the original's modules; call undo()"):
            copy.deepcopy(model)
    twin = copy.deepcopy(model)
    with patch_model(twin, backend="torch"):
        torch.testing.assert_close(logits(twin), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("change, says", [
    (lambda m: m.train(), "was set to training"),  # no gradient reached gate_proj and up_proj
    (lambda m: m.to(torch.bfloat16), "had its weights cast or replaced"),  # "expected m1 and m2 to have the same dtype"
    (lambda m: setattr(m.model.layers[0].mlp.gate_proj, "weight",  # the fused weight kept the old one, silently
                       torch.nn.Parameter(m.model.layers[0].mlp.gate_proj.weight.detach() * 2)),
     "had its weights cast or replaced"),
], ids=["train", "cast", "new-weight"])
def test_a_patched_mlp_refuses_to_run_on_a_stale_fused_weight(change, says):
    model = tiny("llama")
    with patch_model(model, backend="torch"):
        change(model)
        with pytest.raises(IntegrationError, match=f"{says}: call undo\\(\\)"):
            logits(model)


def test_weights_and_biases_loaded_into_a_patched_model_reach_its_fused_gate_up():
    # The fused bias was a copy: load_state_dict changed the biases, the patched MLP kept the old ones.
    model, source = tiny("llama", mlp_bias=True), tiny("llama", mlp_bias=True)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    expected = logits(source)
    with patch_model(model, backend="torch"):
        model.load_state_dict(source.state_dict())
        torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=1e-4)  # undone: its own storage again


def test_a_model_dispatched_by_accelerate_is_refused_unchanged():
    # autosel's forwards replaced accelerate's hooked ones: offloaded weights were never loaded ("meta" tensors).
    model = tiny("llama")
    model.model.layers[1]._hf_hook = object()  # what accelerate's dispatch_model attaches
    with pytest.raises(IntegrationError, match=r"is dispatched by accelerate \(a device_map with hooks on "
                                               r"model.layers.1\)"):
        patch_model(model, backend="torch")
    assert replaced_forwards(model) == [] and getattr(model, "_autosel_patch", None) is None
