"""KV memory as torch tensors on the staged HBM path, on the CPU.

CUDA tensors are served through kvtier's staged path (pinned host staging,
copy kernels, a per-layer GPU counter). Without a GPU these tests run the
same path through its TEST DOUBLE, `test_only_staged_host_double()`: CPU
tensors pose as the GPU's KV memory and the CPU does the kernels' copies.
The GPU itself is tested by test_staged_gpu.py (skipped without one).
"""

import ctypes

import pytest
import torch

import kvtier

LAYERS = 2
BS, HEADS, DIM = 16, 2, 64
OBJ = BS * HEADS * DIM * 2  # one block's K of one layer, bf16


def builder(tmp_path, model, double=True):
    b = (
        kvtier.TierBuilder()
        .directory(tmp_path / "pool")
        .capacity("16m")
        .model(model, block_size=BS)
        .engine("uring")
        .staging(layer_buffers=2, load_blocks=4, store_blocks=4)
    )
    return b.test_only_staged_host_double() if double else b


def cache(layout, blocks):
    """Tensors shaped as vLLM allocates them, filled with random bf16."""
    if layout == "per_layer":
        shape = [(2, blocks, BS, HEADS, DIM)] * LAYERS
    elif layout == "block_major":
        shape = [(blocks, 2, BS, HEADS, DIM)] * LAYERS
    else:
        shape = [(blocks, LAYERS, 2, BS, HEADS, DIM)]
    return [torch.randn(s).to(torch.bfloat16) for s in shape]


def block_layer(tensors, layout, block, layer):
    """The bytes of `block`'s K and V of `layer`, as one uint8 tensor."""
    if layout == "per_layer":
        t = tensors[layer][:, block]
    elif layout == "block_major":
        t = tensors[layer][block]
    else:
        t = tensors[0][block, layer]
    return t.contiguous().view(torch.uint8).flatten()


@pytest.mark.parametrize("layout", ["per_layer", "block_major", "cross_layer"])
def test_double_store_then_load_layer_by_layer(tmp_path, tiny_model, layout):
    blocks = 8
    t = cache(layout, blocks)
    tier = builder(tmp_path, tiny_model).kv_memory(t if layout != "cross_layer" else t[0],
                                                   layout=layout).build()
    assert tier.staged and tier.memory_device == "cpu" and tier.memory_blocks == blocks
    src = [0, 1, 2]
    want = {(b, l): block_layer(t, layout, b, l).clone() for b in src for l in range(LAYERS)}
    keys = [bytes([7, i]) * 16 for i in range(3)]
    r = tier.wait(tier.submit_store(keys, src))
    assert r.ok and r.outcomes == ["done"] * 3
    # The store has ended: overwriting the blocks now must not change what
    # the pool holds.
    for x in t:
        x.zero_()
    dst = [7, 5, 4]
    assert tier.lookup_and_pin(keys) == 3
    job = tier.submit_load(keys, dst)
    for layer in range(LAYERS):
        tier.wait_layer(job, layer)
        # This layer is in; its bytes are exactly what was stored.
        for s, d in zip(src, dst):
            assert torch.equal(block_layer(t, layout, d, layer), want[(s, layer)])
    # With the double no GPU counter exists: the caller waits on the host.
    assert tier.stream_wait_layer(job, 0, 0) is False
    r = tier.wait(job)
    assert r.ok and r.kind == "load"
    tier.unpin(keys)
    # Layer events came in layer order, then the job's end.
    ev = [e for e in tier.drain_completions() if e.job == job]
    assert [e.layer for e in ev if e.kind == "layer"] == list(range(LAYERS))
    assert ev[-1].kind == "finished" and ev[-1].ok
    # Blocks the load did not target are untouched (still zero).
    assert not block_layer(t, layout, 6, 0).any()
    tier.close()


def test_double_partial_layers_and_reopen(tmp_path, tiny_model):
    t = cache("per_layer", 4)
    tier = builder(tmp_path, tiny_model).kv_memory(t).build()
    key = [b"\x01" * 32]
    want = block_layer(t, "per_layer", 0, 1).clone()
    tier.wait(tier.submit_store(key, [0]))
    tier.close()
    # Reopened over fresh tensors (a restart): the stored block is there.
    t2 = cache("per_layer", 4)
    tier = builder(tmp_path, tiny_model).create("never").kv_memory(t2).build()
    before0 = block_layer(t2, "per_layer", 3, 0).clone()
    assert tier.lookup_and_pin(key) == 1
    job = tier.submit_load(key, [3], layers=range(1, 2))
    tier.wait_layer(job, 1)
    with pytest.raises(kvtier.UsageError):
        tier.wait_layer(job, 0)  # not part of this load
    assert tier.wait(job).ok
    tier.unpin(key)
    assert torch.equal(block_layer(t2, "per_layer", 3, 1), want)
    assert torch.equal(block_layer(t2, "per_layer", 3, 0), before0)
    tier.close()


def test_double_load_larger_than_staging_goes_in_chunks(tmp_path, tiny_model):
    t = cache("per_layer", 10)
    tier = builder(tmp_path, tiny_model).kv_memory(t).build()
    keys = [i + 1 for i in range(5)]
    src = list(range(5))
    want = {(b, l): block_layer(t, "per_layer", b, l).clone() for b in src for l in range(LAYERS)}
    assert tier.wait(tier.submit_store(keys, src)).ok  # stores go in chunks
    assert tier.lookup_and_pin(keys) == 5
    dst = [5, 6, 7, 8, 9]  # 5 blocks through layer buffers of 4: 2 chunks a layer
    job = tier.submit_load(keys, dst)
    for layer in range(LAYERS):
        tier.wait_layer(job, layer)
        for s, d in zip(src, dst):
            assert torch.equal(block_layer(t, "per_layer", d, layer), want[(s, layer)])
    assert tier.wait(job).ok
    tier.unpin(keys)
    ev = [e for e in tier.drain_completions() if e.job == job]
    assert [e.layer for e in ev if e.kind == "layer"] == list(range(LAYERS))
    tier.close()


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_double_store_chunks_of_a_store_area(tmp_path, tiny_model, chunk):
    """A store area of 4 blocks in chunks of 1, 2 (several in flight) or 4
    stores 7 blocks whole; a chunk larger than the area is refused, naming it."""
    t = cache("per_layer", 14)
    tier = (
        builder(tmp_path, tiny_model)
        .staging(layer_buffers=2, load_blocks=4, store_blocks=4, store_chunk_blocks=chunk)
        .kv_memory(t)
        .build()
    )
    keys = [i + 1 for i in range(7)]
    src = list(range(7))
    want = {(b, l): block_layer(t, "per_layer", b, l).clone() for b in src for l in range(LAYERS)}
    assert tier.wait(tier.submit_store(keys, src)).ok
    dst = list(range(7, 14))
    assert tier.lookup_and_pin(keys) == 7
    job = tier.submit_load(keys, dst)
    assert tier.wait(job).ok
    tier.unpin(keys)
    for s, d in zip(src, dst):
        for l in range(LAYERS):
            assert torch.equal(block_layer(t, "per_layer", d, l), want[(s, l)])
    tier.close()


def test_double_store_chunk_larger_than_the_area_is_refused(tmp_path, tiny_model):
    b = builder(tmp_path, tiny_model).staging(layer_buffers=2, load_blocks=4, store_blocks=4,
                                              store_chunk_blocks=8)
    with pytest.raises(Exception, match="store_chunk_blocks"):
        b.kv_memory(cache("per_layer", 8)).build()
    with pytest.raises(Exception, match="store_chunk_blocks"):
        builder(tmp_path, tiny_model).staging(store_chunk_blocks=0)


def bad(tmp_path, model, tensors, layout="per_layer", double=True):
    return builder(tmp_path, model, double).kv_memory(tensors, layout=layout).build()


def test_refuses_non_contiguous(tmp_path, tiny_model):
    # vLLM's HND stride orders are permuted views of one allocation.
    t = [torch.zeros(2, 4, HEADS, BS, DIM, dtype=torch.bfloat16).transpose(2, 3)] * LAYERS
    with pytest.raises(kvtier.UsageError, match="not contiguous"):
        bad(tmp_path, tiny_model, t)


def test_refuses_wrong_element_size(tmp_path, tiny_model):
    t = [torch.zeros(2, 4, BS, HEADS, DIM, dtype=torch.float32)] * LAYERS
    with pytest.raises(kvtier.UsageError, match="4-byte elements.*dtype"):
        bad(tmp_path, tiny_model, t)


def test_refuses_wrong_block_counts_and_shapes(tmp_path, tiny_model):
    t = [torch.zeros(2, 4, BS, HEADS, DIM, dtype=torch.bfloat16),
         torch.zeros(2, 3, BS, HEADS, DIM, dtype=torch.bfloat16)]
    with pytest.raises(kvtier.UsageError, match="same size"):
        bad(tmp_path, tiny_model, t)
    with pytest.raises(kvtier.UsageError, match="has 3 tensors"):
        bad(tmp_path, tiny_model, t + t[:1])
    # A per-layer cache given as block-major: K|V is not where it says.
    t = [torch.zeros(2, 4, BS, HEADS, DIM, dtype=torch.bfloat16)] * LAYERS
    with pytest.raises(kvtier.UsageError, match="dimension 1"):
        bad(tmp_path, tiny_model, t, layout="block_major")
    # Heads x dim of another model.
    t = [torch.zeros(2, 4, BS, HEADS, DIM * 2, dtype=torch.bfloat16)] * LAYERS
    with pytest.raises(kvtier.UsageError, match="bytes per block"):
        bad(tmp_path, tiny_model, t)


def test_alignment_16_bytes_for_copies_a_page_for_direct_io(tmp_path, tiny_model):
    n = 2 * 4 * OBJ
    raw = torch.zeros(LAYERS, n + 4096 + 64, dtype=torch.uint8)
    base = raw.data_ptr()

    def at(align_off):
        # Layer tensors starting `align_off` bytes past a page boundary.
        out = []
        for layer in range(LAYERS):
            start = (-(base + layer * raw.shape[1])) % 4096 + align_off
            out.append(raw[layer, start:start + n].view(torch.bfloat16).view(2, 4, BS, HEADS, DIM))
        return out

    # 8 bytes off: too little even for the copy kernels' 16-byte vectors.
    with pytest.raises(kvtier.KvtierError, match="16|alignment"):
        bad(tmp_path, tiny_model, at(8))
    # 16 bytes off: enough for the staged path (the double, like a GPU)...
    tier = bad(tmp_path / "a", tiny_model, at(16))
    tier.close()
    # ...not for direct I/O into host memory.
    with pytest.raises(kvtier.KvtierError, match="4096|alignment"):
        bad(tmp_path / "b", tiny_model, at(16), double=False)


def test_double_applies_to_tensors_only(tmp_path, tiny_model):
    with pytest.raises(kvtier.UsageError, match="host_cache"):
        builder(tmp_path, tiny_model).host_cache(4).build()
    with pytest.raises(kvtier.UsageError, match="layer_buffers"):
        kvtier.TierBuilder().staging(layer_buffers=1)


class _CudaTensorDescription:
    """What the builder reads of a CUDA tensor (device, shape, data_ptr...),
    for the machine without a GPU, where torch cannot make one: the build
    must fail before anything touches the address."""

    def __init__(self, host: torch.Tensor) -> None:
        self._t = host
        self.device = type("Dev", (), {"type": "cuda", "index": 0})()
        self.shape = host.shape

    def is_contiguous(self):
        return True

    def stride(self):
        return self._t.stride()

    def data_ptr(self):
        return self._t.data_ptr()

    def numel(self):
        return self._t.numel()

    def element_size(self):
        return self._t.element_size()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: test_staged_gpu.py runs")
def test_cuda_tensors_without_a_gpu_name_the_fix(tmp_path, tiny_model):
    t = [_CudaTensorDescription(x) for x in cache("per_layer", 4)]
    with pytest.raises(kvtier.UnsupportedError) as e:
        bad(tmp_path, tiny_model, t, double=False)
    msg = str(e.value)
    assert "staged HBM path" in msg and "fix:" in msg and "CPU tensors" in msg
    # The double copies with the CPU: it never takes device memory.
    with pytest.raises(kvtier.UsageError, match="CPU tensors posing"):
        bad(tmp_path, tiny_model, t, double=True)


def test_double_host_copies(tmp_path, tiny_model):
    # write_block/read_block copy with the CPU: the double's memory is host memory.
    t = cache("per_layer", 4)
    tier = builder(tmp_path, tiny_model).kv_memory(t).build()
    data = bytes(range(256)) * (2 * LAYERS * OBJ // 256)
    tier.write_block(2, data)
    assert tier.read_block(2) == data
    buf = (ctypes.c_char * OBJ)()
    tier.read_block_into(2, buf)
    assert bytes(buf) == data[:OBJ]
    tier.close()
