"""kvtier from Python: store a few blocks of KV, reopen the pool (a restart),
load them back layer by layer, check the bytes. Runs as written:

    python python/examples/quickstart.py [POOL_DIR]
"""

import sys
import tempfile

import torch

import kvtier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 64, 16  # one K (or V) object = 4 KiB
BLOCKS = 8  # memory blocks in the engine's KV cache


def aligned_kv_layers() -> list[torch.Tensor]:
    """One (2, blocks, block_size, heads, dim) tensor per layer ("per_layer"),
    4096-byte aligned for direct I/O (torch's CPU allocator aligns to 64)."""
    n = 2 * BLOCKS * BLOCK * KV_HEADS * HEAD_DIM
    out = []
    for _ in range(LAYERS):
        raw = torch.zeros(n + 4096, dtype=torch.bfloat16)
        off = (-raw.data_ptr() % 4096) // raw.element_size()
        out.append(raw[off:off + n].view(2, BLOCKS, BLOCK, KV_HEADS, HEAD_DIM))
    return out


def open_tier(pool_dir: str, layers: list[torch.Tensor]) -> kvtier.TierHandle:
    return (kvtier.TierBuilder()
            .directory(pool_dir).capacity("64m")          # created if absent, opened if not
            .geometry(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                      dtype="bfloat16", block_size=BLOCK, name="quickstart")
            .kv_memory(layers, layout="per_layer")
            .build())


def main() -> None:
    pool_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kvtier-")
    keys = [f"prefix-block-{i}".encode() for i in range(4)]  # a prefix's block hashes

    # An engine computed KV for 4 blocks in memory blocks 1, 5, 2, 7: store
    # them. (A key names its content: the same prefix gives the same KV, here
    # by a fixed seed; a key already in the pool is not written again.)
    src = aligned_kv_layers()
    gen = torch.Generator().manual_seed(0)
    for t in src:
        t.normal_(generator=gen)
    with open_tier(pool_dir, src) as tier:
        tier.wait(tier.submit_store(keys, [1, 5, 2, 7])).raise_for_failure()

    # A fresh engine (zeroed KV memory) on the same pool: look the prefix up,
    # pin it, load it into memory blocks 0-3 layer by layer.
    dst = aligned_kv_layers()
    with open_tier(pool_dir, dst) as tier:
        n = tier.lookup_and_pin(keys)
        job = tier.submit_load(keys[:n], [0, 1, 2, 3][:n])
        for layer in range(LAYERS):
            tier.wait_layer(job, layer)  # this layer is in memory: attention may run
            for a, b in zip([1, 5, 2, 7], range(n)):
                assert torch.equal(dst[layer][:, b], src[layer][:, a]), (layer, b)
        tier.wait(job).raise_for_failure()
        tier.unpin(keys[:n])
    print(f"restored {n} blocks x {LAYERS} layers from {pool_dir}: bytes equal")


if __name__ == "__main__":
    main()
