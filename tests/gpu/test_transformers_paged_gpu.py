"""On a GPU: transformers' continuous batching (generate_batch) with attention through autosel (route_paged_attention)
gives, in bf16, the greedy tokens of transformers' own paged attention (sdpa), with the default backends (autosel
choosing per batch) and with each GPU backend forced. Skipped without CUDA or transformers 5.24 (carry .hfw)."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

torch = pytest.importorskip("torch")


def _unsupported_transformers() -> str | None:
    """Why the installed transformers cannot run these tests, read without importing it (the H200 image has 5.17;
    dev/gpu_env.sh installs the carried 5.24 from .hfw)."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (pip install -e '.[hf]')"
    installed = importlib.metadata.version("transformers")
    return None if installed.startswith("5.24.") else f"needs transformers 5.24, not {installed} (carry .hfw)"


_CUDA = torch.cuda.is_available()
_UNSUPPORTED = _unsupported_transformers() if _CUDA else None
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _CUDA, reason="needs a CUDA device"),
              pytest.mark.skipif(_UNSUPPORTED is not None, reason=_UNSUPPORTED or "")]

DEVICE = "cuda"
# Prompts of 1 to 700 tokens in steps of at most 256 and pages of 16: first prefills, chunked prefills on a cached
# prefix, mixed steps, decode-only steps; Llama-3-like heads (8 query heads over 2 KV heads of 128).
LENGTHS = (1, 5, 37, 130, 300, 700)
SETTINGS = dict(page_size=16, num_blocks=512, max_batch_tokens=256)
NEW_TOKENS = 16


def tiny_llama():
    import transformers

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, 1024, (n,), generator=generator).tolist() for n in LENGTHS]


def generate(model, batching_config) -> list[list[int]]:
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)
    out = model.generate_batch(prompts(), generation_config=config, continuous_batching_config=batching_config)
    errors = [o.error for o in out.values() if o.error is not None]
    assert len(out) == len(LENGTHS) and not errors, errors
    return [o.generated_tokens for o in out.values()]


def parted_beyond_near_ties(model, expected: list[list[int]], got: list[list[int]]) -> list[str]:
    """Where the tokens part, transformers' own logits there (a plain forward, bf16) must be a near tie: top two
    within 2e-2 of the largest logit (tools/hf_check.py's rule: bf16 spaces values near it 2^-8 of it apart)."""
    problems = []
    for prompt, want, have in zip(prompts(), expected, got):
        step = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if step is None:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + want[:step]], device=DEVICE)).logits[0, -1].float()
        top = logits.topk(2).values
        margin, scale = float(top[0] - top[1]), float(logits.abs().max())
        if margin > 2e-2 * scale:
            problems.append(f"prompt of {len(prompt)} tokens parted at token {step} ({want[step]} -> {have[step]}) "
                            f"with a top-2 margin of {margin:.3g}, largest logit {scale:.3g}")
    return problems


def check(backend: str | None) -> None:
    import transformers

    from autosel.integrations.transformers_paged import route_paged_attention

    model = tiny_llama()
    expected = generate(model, transformers.ContinuousBatchingConfig(**SETTINGS, auto_switch_to_flash=False))
    with route_paged_attention(model, backend=backend) as routed:
        got = generate(model, routed.batching_config(**SETTINGS))
    assert routed.plans["attention.decode"] > 0 and routed.plans["attention.extend"] > 0, routed.plans
    assert routed.layer_calls == 2 * sum(routed.plans.values())
    problems = parted_beyond_near_ties(model, expected, got)
    assert not problems, f"backends {dict(routed.backends)}: " + "; ".join(problems)


@pytest.mark.parametrize("backend", ["torch", "flashinfer", "sgl_kernel"])
def test_each_backend_gives_transformers_tokens(backend):
    import autosel
    from autosel.platforms import current_platform

    reason = autosel.select_kernel("attention.decode", backend).unavailable_reason(current_platform())
    if reason:
        pytest.skip(f"{backend}: {reason}")
    check(backend)


def test_default_backends_give_transformers_tokens(monkeypatch):
    # Last: a miss tunes both ops here, on the test's own DB (the longest of these tests).
    monkeypatch.setenv("AUTOSEL_BUDGET_S", "5")
    check(None)
