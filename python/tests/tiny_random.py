"""Tiny models with random weights (normal init, seeded), saved where vLLM
and transformers both load them: a config.json plus model.safetensors.
Unlike vLLM's dummy weights (uniform +-1e-3, near-uniform attention), these
make the output depend on the prefix's KV.

``make(dest)`` is the project's tiny llama (2 KV heads, head_dim 64);
``make(dest, kv_heads=8, heads=16, head_dim=128)`` and friends give the
shapes users serve (GQA, MHA, MQA, head_dim 64/128/256)."""

import json
import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


def make(dest: str, seed: int = 0, *, kv_heads: int | None = None, heads: int | None = None,
         head_dim: int | None = None, layers: int | None = None, hidden: int | None = None,
         max_position: int | None = None) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    os.makedirs(dest, exist_ok=True)
    with open(os.path.join(HERE, "tiny-llama", "config.json")) as f:
        cfg = json.load(f)
    if kv_heads is not None:
        heads = heads or kv_heads
        cfg.update(num_key_value_heads=kv_heads, num_attention_heads=heads, head_dim=head_dim,
                   hidden_size=max(128, min(heads * head_dim, 512)),
                   _name_or_path=f"kvtier-tiny-llama-kv{kv_heads}-h{heads}-d{head_dim}")
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    if hidden is not None:
        cfg.update(hidden_size=hidden, intermediate_size=2 * hidden)
    if max_position is not None:
        cfg["max_position_embeddings"] = max_position
    if kv_heads is None and layers is None and hidden is None and max_position is None:
        shutil.copy(os.path.join(HERE, "tiny-llama", "config.json"), dest)
    else:
        with open(os.path.join(dest, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    config = LlamaConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    return dest


def make_mla(dest: str, seed: int = 0) -> str:
    """A tiny DeepSeek-V2 (MLA: a 512-wide latent plus 64 rope dims per
    token, one KV "head"), dense layers only, random weights."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=64, qk_nope_head_dim=64,
        max_position_embeddings=512, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rope_scaling=None)
    cfg._name_or_path = "kvtier-tiny-deepseek-v2"
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    return dest


def make_gemma3(dest: str, seed: int = 0) -> str:
    """A tiny Gemma-3 text model: sliding-window layers (window 64) between
    full-attention ones, q/k norms, one KV head of 256 (MQA), random
    weights. vLLM gives it two KV cache groups when its hybrid cache manager
    is on (a connector without HMA support runs it as one)."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=1024, sliding_window=64, sliding_window_pattern=2,
        torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg._name_or_path = "kvtier-tiny-gemma3"
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}, cfg.layer_types
    torch.manual_seed(seed)
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    return dest


def make_qwen3(dest: str, seed: int = 0) -> str:
    """A tiny Qwen3 (q/k norms, GQA 2 KV heads x 128 apart from the hidden
    size), random weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    cfg = Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=1024, torch_dtype="bfloat16", bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    cfg._name_or_path = "kvtier-tiny-qwen3"
    torch.manual_seed(seed)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(dest, safe_serialization=True)
    return dest
