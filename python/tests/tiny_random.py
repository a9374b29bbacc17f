"""A tiny llama with random weights (normal init, seeded), saved where vLLM
and transformers both load it: the local config.json of tiny-llama plus
model.safetensors. Unlike vLLM's dummy weights (uniform +-1e-3, near-uniform
attention), these make the output depend on the prefix's KV."""

import os
import shutil

HERE = os.path.dirname(os.path.abspath(__file__))


def make(dest: str, seed: int = 0) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(dest, "model.safetensors")):
        return dest
    os.makedirs(dest, exist_ok=True)
    shutil.copy(os.path.join(HERE, "tiny-llama", "config.json"), dest)
    cfg = LlamaConfig.from_pretrained(dest)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    return dest
