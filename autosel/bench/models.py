"""The model configurations `autosel bench model` and tools/hf_check.py build with random weights: the published ones
at real dimensions, one tensor-parallel rank's share of two, and a tiny Llama for running the benchmark's logic on
a CPU in seconds."""

from __future__ import annotations

import torch
import transformers

# The published configurations (config.json of meta-llama/Meta-Llama-3-8B, Qwen/Qwen3-8B, Qwen/Qwen3-32B), less layers.
MODELS = {
    "llama-3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen3-8b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen3-32b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_attention_heads=64, num_key_value_heads=8,
        head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # One tensor-parallel rank's share of a published model (its heads and intermediate size over the ranks, the hidden
    # size whole, no all-reduce): the narrow gated rows and few heads a serving engine's rank runs, which autosel's
    # Triton kernels' tiles were chosen for (docs/KERNELS.md). Llama-3-70B at 8 ranks: 8 / 1 heads, intermediate
    # 3584; Qwen2.5-32B at 8: 5 / 1 heads, intermediate 3456.
    "llama-3-70b-tp8": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672 // 8, num_attention_heads=64 // 8,
        num_key_value_heads=8 // 8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "qwen2.5-32b-tp8": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        vocab_size=152064, hidden_size=5120, intermediate_size=27648 // 8, num_attention_heads=40 // 8,
        num_key_value_heads=8 // 8, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    # Not a published model: Llama's structure at dimensions a CPU runs in milliseconds (`autosel bench model --tiny`).
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def build(name: str, layers: int, device: str, dtype: torch.dtype):
    """MODELS[name] with `layers` decoder layers and transformers' own random initialisation (seed 0), in eval mode."""
    config_name, model_name, settings = MODELS[name]
    config = getattr(transformers, config_name)(num_hidden_layers=layers, **settings)
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, model_name)(config).to(dtype).eval()
