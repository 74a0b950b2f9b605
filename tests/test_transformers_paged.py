"""autosel.integrations.transformers_paged on a tiny random Llama: transformers' continuous batching (generate_batch,
its paged cache) with attention through autosel's planned ops gives the greedy tokens of transformers' own paged
attention, plans once per step for every layer, and refuses what it cannot run with the reason."""

from __future__ import annotations

import importlib.util
import re

import pytest
import torch

from autosel.errors import IntegrationError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="transformers is not installed (pip install -e '.[hf]')")
transformers = route_paged_attention = None  # imported by the fixture below


@pytest.fixture(autouse=True, scope="module")
def imported_when_run():
    # Imported when run, not at collection: transformers imports torch._dynamo and with it triton, which must not
    # take compiled mode before tests/test_triton_kernels.py imports its kernels (as in test_integrations_transformers).
    global transformers, route_paged_attention
    import transformers as library

    from autosel.integrations import transformers_paged

    transformers, route_paged_attention = library, transformers_paged.route_paged_attention


LAYERS = 3
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen3": "Qwen3"}
# Prompts of 11, 3, 20, 1 and 7 tokens in steps of at most 8 tokens and pages of 4: first prefills, prefills chunked
# over a cached prefix, steps mixing decodes with a prefill chunk, and decode-only steps, sequences ending mid-page.
PROMPTS = [list(range(1, 12)), [7, 8, 9], list(range(10, 30)), [5], list(range(40, 47))]
SETTINGS = dict(page_size=4, num_blocks=64, max_batch_tokens=8)


def tiny_llama(family: str = "llama", **overrides):
    config_class, model_class = (getattr(transformers, FAMILIES[family] + kind) for kind in ("Config", "ForCausalLM"))
    settings = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return model_class(config_class(**(settings | overrides))).eval()


def generate(model, batching_config) -> tuple[list[list[int]], list[str | None]]:
    """Greedy tokens and errors per prompt, in the prompts' order. float32: in bf16 a random model's near-tied logits
    could flip a greedy token within tolerance."""
    config = transformers.GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=batching_config)
    assert len(out) == len(PROMPTS)
    return [o.generated_tokens for o in out.values()], [o.error for o in out.values()]


def transformers_own(model):
    return generate(model, transformers.ContinuousBatchingConfig(**SETTINGS, auto_switch_to_flash=False))


class Steps:
    """Each forward's (new tokens, cached-plus-new tokens) per sequence, as transformers passed them to the model."""

    def __init__(self, model) -> None:
        self.seen: list[tuple[list[int], list[int]]] = []
        self.hook = model.register_forward_pre_hook(self.record, with_kwargs=True)

    def record(self, model, args, kwargs) -> None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"]["full_attention"].tolist()
        self.seen.append(([b - a for a, b in zip(cu_q, cu_q[1:])], [b - a for a, b in zip(cu_k, cu_k[1:])]))


@pytest.mark.parametrize("family, reference", [("llama", "sdpa"), ("llama", "paged|eager"), ("qwen3", "sdpa")])
def test_greedy_tokens_equal_transformers_own_paged_attention(family, reference):
    model = tiny_llama(family)
    model.config._attn_implementation = reference  # what continuous batching runs on besides flash
    expected = transformers_own(model)
    steps = Steps(model)
    with route_paged_attention(model, backend="torch") as routed:
        got = generate(model, routed.batching_config(**SETTINGS))
    assert got == expected and got[1] == [None] * len(PROMPTS)
    kinds = {"decode" if set(q) == {1} else "prefill" if q == k else "extend on a cached prefix"
             for q, k in steps.seen}
    assert kinds == {"decode", "prefill", "extend on a cached prefix"}
    assert any(1 in q and max(q) > 1 for q, _ in steps.seen)  # a step mixing decodes and a prefill chunk
    assert routed.plans["attention.decode"] > 0 and routed.plans["attention.extend"] > 0


def test_one_plan_per_step_run_by_every_layer():
    from collections import Counter

    model = tiny_llama()
    steps = Steps(model)
    made = Counter()
    with route_paged_attention(model, backend="torch") as routed:
        for op, planner in routed.planners.items():  # counted where autosel's Planner makes each plan
            def counted(batch, make=planner.make_plan, op=op):
                made[op] += 1
                return make(batch)
            planner.make_plan = counted
        generate(model, routed.batching_config(**SETTINGS))
    assert made == routed.plans and sum(made.values()) == len(steps.seen) > 5
    assert routed.layer_calls == LAYERS * len(steps.seen)
    decodes = sum(set(q) == {1} for q, _ in steps.seen)
    assert routed.plans["attention.decode"] == decodes
    assert routed.backends == {"torch": len(steps.seen)}


def test_transformers_gathers_no_cached_kv_for_routed_layers(monkeypatch):
    # Each layer's cache.update copied every cached token's K/V into new tensors that autosel's plans never read.
    from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

    read = []
    update = FullAttentionCacheAllocator.update

    def spy(self, key_states, value_states, layer_idx, read_index, write_index):
        read.append(read_index.numel())
        return update(self, key_states, value_states, layer_idx, read_index, write_index)

    monkeypatch.setattr(FullAttentionCacheAllocator, "update", spy)
    model = tiny_llama()
    expected = transformers_own(model)
    assert max(read) > 0
    read.clear()
    with route_paged_attention(model, backend="torch") as routed:
        assert generate(model, routed.batching_config(**SETTINGS)) == expected
    assert read and max(read) == 0 and routed.plans["attention.extend"] > 0


def test_with_patch_model_too():
    # patch_model's rope read the cache's length through get_seq_length, which the paged cache does not have: every
    # request failed with an AttributeError.
    from autosel.integrations.transformers import patch_model

    model = tiny_llama()
    expected = transformers_own(model)
    with patch_model(model, backend="torch"), route_paged_attention(model, backend="torch") as routed:
        got = generate(model, routed.batching_config(**SETTINGS))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert routed.plans["attention.decode"] > 0


def test_forwards_without_a_paged_cache_keep_the_models_attention_and_undo_restores():
    model = tiny_llama()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    routed = route_paged_attention(model, backend="torch")
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert sum(routed.plans.values()) == 0
    routed.undo()
    routed.undo()
    assert all(layer.self_attn.config is model.config and not hasattr(layer.self_attn, "_autosel_paged")
               for layer in model.model.layers)
    assert not hasattr(model, "_autosel_paged") and not model._forward_pre_hooks and not model._forward_hooks
    transformers_own(model)
    assert sum(routed.plans.values()) == 0


def test_a_batch_no_backend_can_run_fails_its_requests_with_the_reason(monkeypatch):
    # A backend whose kernel takes at most 4 new tokens per sequence (its module's supports says so), forced: the
    # prompts' prefills are batches it cannot run. transformers catches errors in its generation thread and reports
    # them per request.
    from autosel import KernelBackend, KernelSpec, PlatformInfo
    from conftest import use_fresh_registry

    fresh = use_fresh_registry(monkeypatch, PlatformInfo.detect(), builtin=True)
    for op in ("attention.decode", "attention.extend"):
        fresh.register(KernelSpec(op, KernelBackend.JIT, "test_transformers_paged:ShortPlan"))
    model = tiny_llama()
    with route_paged_attention(model, backend="jit") as routed:
        _, errors = generate(model, routed.batching_config(**SETTINGS))
    reason = re.compile(r"attention.extend: no backend can run this batch: jit: \d+ new tokens in one sequence, over "
                        r"this kernel's 4")
    assert all(e is not None and reason.search(e) for e in errors), errors
    assert sum(routed.plans.values()) == 0


def supports(batch) -> str | None:
    """ShortPlan's limit, read by autosel.planned.supports_of as a vendor module's would be."""
    return None if batch.max_q <= 4 else f"{batch.max_q} new tokens in one sequence, over this kernel's 4"


class ShortPlan:
    def __init__(self, batch) -> None:
        from autosel.ops import attention_torch

        self.plan = (attention_torch.DecodePlan if batch.is_decode else attention_torch.ExtendPlan)(batch)

    def run(self, q, k_cache, v_cache):
        return self.plan.run(q, k_cache, v_cache)


@pytest.mark.parametrize("family, overrides, match", [
    ("mistral", {"sliding_window": 16}, r"sliding-window attention \(layer types \['sliding_attention'\], "
                                        r"sliding_window=16\)"),
    ("llama", {"layer_types": ["full_attention", "sliding_attention", "full_attention"], "sliding_window": 16},
     r"sliding-window attention"),
])
def test_sliding_window_models_are_refused_and_left_unchanged(family, overrides, match):
    model = tiny_llama(family, **overrides)
    with pytest.raises(IntegrationError, match=match):
        route_paged_attention(model, backend="torch")
    assert all(layer.self_attn.config is model.config for layer in model.model.layers)
    assert not model._forward_pre_hooks and not hasattr(model, "_autosel_paged")


def test_refusals_before_anything_changes():
    model = tiny_llama()
    with pytest.raises(IntegrationError, match=r"backend='flashinfer' cannot run attention.decode on this machine"):
        route_paged_attention(model, backend="flashinfer")
    with route_paged_attention(model, backend="torch") as routed:
        with pytest.raises(IntegrationError, match="already routed"):
            route_paged_attention(model, backend="torch")
        with pytest.raises(ValueError, match=r"batching_config\(max_blocks_per_request=8\): autosel's paged attention "
                                             r"needs max_blocks_per_request=0"):
            routed.batching_config(max_blocks_per_request=8)


def test_the_docs_snippet_runs_as_pasted(tmp_path):
    from conftest import run_snippet

    result = run_snippet("docs/TRANSFORMERS.md", "## Continuous batching: attention through autosel", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "{'attention.extend': 1, 'attention.decode': 7}"
