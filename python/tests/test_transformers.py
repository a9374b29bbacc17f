"""A real model's numbers: a tiny Hugging Face llama (random weights, local
config). The prefix's KV goes through kvtier (stored, the pool closed and
reopened), comes back layer by layer into a fresh cache, and the suffix is
prefilled on it: the restored state is bit-identical to the original, so
the logits equal those on the original cache exactly, and those of
recomputing the whole prompt within bf16 tolerance."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvtier  # noqa: E402

BS = 16


def aligned_layers(layers, blocks, per_token, dtype):
    """Per-layer block-major tensors, page aligned for kvtier's direct I/O."""
    out = []
    n = blocks * 2 * BS * per_token
    esz = torch.tensor([], dtype=dtype).element_size()
    for _ in range(layers):
        raw = torch.zeros(n + 4096 // esz, dtype=dtype)
        off = (-raw.data_ptr() % 4096) // esz
        out.append(raw[off : off + n].view(blocks, 2, BS, per_token))
    return out


def open_tier(pool, cfg, mem):
    return (
        kvtier.TierBuilder()
        .directory(pool)
        .capacity("64m")
        .model(cfg, block_size=BS, dtype="bfloat16")
        .policy("naive")
        .kv_memory(mem, layout="block_major")
        .build()
    )


def test_prefix_kv_through_kvtier_gives_the_same_logits(tmp_path):
    import tiny_random
    from transformers import DynamicCache, LlamaForCausalLM

    model_dir = tiny_random.make(str(tmp_path / "model"))
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    c = model.config
    heads, dim, layers = c.num_key_value_heads, c.head_dim, c.num_hidden_layers
    g = torch.Generator().manual_seed(5)
    prefix_blocks = 3
    prompt = torch.randint(3, c.vocab_size, (1, prefix_blocks * BS + 11), generator=g)
    prefix, suffix = prompt[:, : prefix_blocks * BS], prompt[:, prefix_blocks * BS :]
    keys = [f"prefix-{i}".encode() for i in range(prefix_blocks)]

    with torch.no_grad():
        full = model(prompt).logits[:, prefix_blocks * BS :]
        cache = model(prefix, use_cache=True).past_key_values

        # Store: each block's K and V of every layer, (tokens, heads*dim) each.
        mem = aligned_layers(layers, 8, heads * dim, torch.bfloat16)
        for l in range(layers):
            k, v = cache.layers[l].keys[0], cache.layers[l].values[0]  # (heads, T, dim)
            for b in range(prefix_blocks):
                sl = slice(b * BS, (b + 1) * BS)
                mem[l][b, 0] = k[:, sl].transpose(0, 1).reshape(BS, heads * dim)
                mem[l][b, 1] = v[:, sl].transpose(0, 1).reshape(BS, heads * dim)
        pool = tmp_path / "pool"
        tier = open_tier(pool, model_dir, mem)
        tier.wait(tier.submit_store(keys, list(range(prefix_blocks)))).raise_for_failure()
        tier.close()

        # Restart: a fresh handle over fresh (zeroed) memory; the prefix is a hit.
        fresh = aligned_layers(layers, 8, heads * dim, torch.bfloat16)
        tier = open_tier(pool, model_dir, fresh)
        assert tier.lookup_and_pin(keys) == prefix_blocks
        dest = [4, 6, 5]  # any free blocks of the fresh cache
        job = tier.submit_load(keys, dest)
        restored = DynamicCache()
        for l in range(layers):
            tier.wait_layer(job, l)  # this layer only; later ones may still be in flight
            kv = fresh[l][dest]  # (blocks, 2, BS, heads*dim)
            k = kv[:, 0].reshape(-1, heads, dim).transpose(0, 1).unsqueeze(0).contiguous()
            v = kv[:, 1].reshape(-1, heads, dim).transpose(0, 1).unsqueeze(0).contiguous()
            assert torch.equal(k, cache.layers[l].keys), f"layer {l} K differs after kvtier"
            assert torch.equal(v, cache.layers[l].values), f"layer {l} V differs after kvtier"
            restored.update(k, v, l)
        assert tier.wait(job).ok
        tier.unpin(keys)
        tier.close()

        on_restored = model(suffix, past_key_values=restored).logits
        on_original = model(suffix, past_key_values=cache).logits

    # Bit-identical state, so bit-identical logits.
    assert torch.equal(on_restored, on_original)
    # Against recomputing the whole prompt: the same math in other shapes,
    # so bf16 rounding differs; the tolerance is bf16's (8 mantissa bits).
    diff = (on_restored.float() - full.float()).abs().max().item()
    scale = full.float().abs().max().item()
    print(f"restored vs whole-prompt logits: max |diff| {diff:.3g}, max |logit| {scale:.3g}")
    assert diff <= 2 ** -6 * max(scale, 1.0), (diff, scale)
    assert torch.equal(on_restored.argmax(-1), full.argmax(-1))
