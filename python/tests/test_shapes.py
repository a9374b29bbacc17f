"""The kvtier module with the shapes users serve, not only the tiny llama the
rest of the tests use: model families (GQA 8 KV heads, MHA 32 KV heads,
MQA, an MLA latent), head_dim 64 / 96 / 128 / 256 / 576, 1 and 61 layers,
16 / 32 / 64-token blocks, bf16 / fp16 / fp32 / fp8, every CPU layout;
store, reopen, load layer by layer into other blocks, bytes equal. Then
what a new user passes by mistake (or by habit: torch dtypes, torch tensors
of block ids): a clear exception naming the thing and the fix, never wrong
bytes."""

import pytest

import kvtier

torch = pytest.importorskip("torch")

BLOCKS = 6
SRC = [1, 4, 5]  # memory blocks stored
DST = [0, 2, 3]  # memory blocks a fresh engine loads them into
KEYS = [b"\x01" * 32, 7, b"prefix-2"]  # a SHA-256, an int, a short hash

TORCH_DTYPE = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}

# (layers, kv_heads, head_dim, dtype, block_size, layout)
SHAPES = {
    "gqa8x128-bf16-bs16": (2, 8, 128, "bfloat16", 16, "per_layer"),
    "mha32x64-fp16-bs32": (2, 32, 64, "float16", 32, "block_major"),
    "mha32x128-bf16-bs16-1layer": (1, 32, 128, "bfloat16", 16, "per_layer"),
    "mqa1x64-fp16-bs64-61layers": (61, 1, 64, "float16", 64, "block_major"),
    "gqa4x256-bf16-bs64": (3, 4, 256, "bfloat16", 64, "cross_layer"),
    "mla576-bf16-bs64": (2, 1, 576, "bfloat16", 64, "per_layer"),
    "gqa8x128-fp32-bs32": (2, 8, 128, "float32", 32, "cross_layer"),
    "gqa8x96-fp16-bs16": (5, 8, 96, "float16", 16, "block_major"),
    "gqa8x128-fp8-bs16": (2, 8, 128, "fp8", 16, "per_layer"),
    "gqa8x64-fp8-bs64-uint8": (3, 8, 64, "fp8", 64, "block_major"),
}


def aligned(n, dtype):
    """n elements of dtype at a 4096-byte boundary (direct I/O)."""
    es = torch.empty(0, dtype=dtype).element_size()
    raw = torch.zeros(n + 4096 // es, dtype=dtype)
    off = (-raw.data_ptr() % 4096) // es
    return raw[off:off + n]


def kv_tensors(layers, heads, dim, dtype, bs, layout):
    obj = (bs, heads, dim)
    if layout == "cross_layer":
        return [aligned(BLOCKS * layers * 2 * bs * heads * dim, dtype).view(BLOCKS, layers, 2, *obj)]
    shape = (2, BLOCKS, *obj) if layout == "per_layer" else (BLOCKS, 2, *obj)
    return [aligned(2 * BLOCKS * bs * heads * dim, dtype).view(shape) for _ in range(layers)]


def block_of(tensors, layout, layer, block):
    """One layer's K and V of one memory block, as bytes."""
    if layout == "cross_layer":
        t = tensors[0][block, layer]
    elif layout == "per_layer":
        t = tensors[layer][:, block]
    else:
        t = tensors[layer][block]
    return t.contiguous().view(torch.uint8)


def open_tier(path, geometry, tensors, layout):
    layers, heads, dim, dtype, bs = geometry
    return (kvtier.TierBuilder().directory(path).capacity("96m")
            .geometry(layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype,
                      block_size=bs, name="shapes")
            .kv_memory(tensors, layout=layout).build())


@pytest.mark.parametrize("shape", list(SHAPES))
def test_shape_round_trips_layer_by_layer_after_a_restart(tmp_path, shape):
    layers, heads, dim, dtype, bs, layout = SHAPES[shape]
    tdt = torch.uint8 if shape.endswith("uint8") else TORCH_DTYPE[dtype]
    src = kv_tensors(layers, heads, dim, tdt, bs, layout)
    gen = torch.Generator().manual_seed(len(shape))
    for t in src:
        # Random bytes: every bit pattern, fp8 and NaN payloads included.
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                generator=gen, dtype=torch.uint8))
    geometry = (layers, heads, dim, dtype, bs)
    with open_tier(tmp_path, geometry, src, layout) as tier:
        assert tier.geometry["object_bytes"] == bs * heads * dim * src[0].element_size()
        tier.wait(tier.submit_store(KEYS, SRC)).raise_for_failure()

    dst = kv_tensors(layers, heads, dim, tdt, bs, layout)
    with open_tier(tmp_path, geometry, dst, layout) as tier:
        assert tier.lookup_and_pin(KEYS) == len(KEYS)
        job = tier.submit_load(KEYS, DST)
        for layer in range(layers):
            tier.wait_layer(job, layer)
            for a, b in zip(SRC, DST):
                assert torch.equal(block_of(dst, layout, layer, b),
                                   block_of(src, layout, layer, a)), (shape, layer, b)
        tier.wait(job).raise_for_failure()
        tier.unpin(KEYS)
        # Blocks nothing was loaded into stay zero.
        for layer in range(layers):
            for b in set(range(BLOCKS)) - set(DST):
                assert not block_of(dst, layout, layer, b).any()


def small_tier(tmp_path, tensors=None, dtype="bfloat16"):
    tensors = tensors if tensors is not None else kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")
    return (kvtier.TierBuilder().directory(tmp_path / "pool").capacity("16m")
            .geometry(layers=2, kv_heads=2, head_dim=64, dtype=dtype, block_size=16, name="m")
            .kv_memory(tensors).build())


@pytest.mark.parametrize("cache,model", [
    (torch.float16, "bfloat16"), (torch.bfloat16, "float16"),
    (torch.float8_e5m2, "fp8"), (torch.float8_e4m3fn, "fp8_e5m2"),
])
def test_a_cache_of_another_float_dtype_of_the_same_size_is_refused(tmp_path, cache, model):
    # Same element size, other bytes: registered, the pool (whose namespace
    # says `model`) would hand fp16 bits to an engine that reads bf16.
    t = kv_tensors(2, 2, 64, cache, 16 if cache.itemsize == 2 else 32, "per_layer")
    b = (kvtier.TierBuilder().directory(tmp_path / "pool").capacity("16m")
         .geometry(layers=2, kv_heads=2, head_dim=64, dtype=model,
                   block_size=16 if cache.itemsize == 2 else 32, name="m")
         .kv_memory(t))
    with pytest.raises(kvtier.UsageError, match=rf"{cache}.*dtype=") as e:
        b.build()
    assert "uint8" in str(e.value)  # names the byte-view way out too


def test_byte_and_integer_views_of_a_cache_are_raw_bytes(tmp_path):
    # vLLM keeps fp8 caches as uint8 and the connector registers byte views:
    # those carry no dtype of their own and are accepted.
    t = [x.view(torch.uint8) for x in kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")]
    with small_tier(tmp_path, t) as tier:
        assert tier.memory_blocks == BLOCKS
    t = [x.view(torch.int16) for x in kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")]
    with small_tier(tmp_path, t) as tier:
        assert tier.memory_blocks == BLOCKS


def test_torch_dtypes_are_dtype_names(tmp_path, tiny_model):
    # A cache tensor's .dtype is what a user has at hand.
    with small_tier(tmp_path, dtype=torch.bfloat16) as tier:
        assert tier.geometry["dtype"] == "bfloat16"
    g, _ = kvtier.resolve_model(tiny_model, block_size=16, dtype=torch.float16)
    assert g["dtype"] == "float16"
    b = kvtier.TierBuilder().model(tiny_model, block_size=16, dtype=torch.float32)
    assert b is not None
    with pytest.raises(TypeError, match="torch dtype"):
        kvtier.TierBuilder().model(tiny_model, dtype=2)
    with pytest.raises(kvtier.UsageError, match="unknown"):
        kvtier.TierBuilder().geometry(layers=1, kv_heads=1, head_dim=64, dtype=torch.int32,
                                      block_size=64, name="m")


@pytest.mark.parametrize("arg", ["layers", "kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [-1, 2**32])
def test_geometry_ints_out_of_range_name_the_argument(arg, value):
    kw = dict(layers=2, kv_heads=2, head_dim=64, dtype="bfloat16", block_size=16, name="m")
    kw[arg] = value
    # pyo3's own message ("out of range integral type conversion attempted")
    # named nothing.
    with pytest.raises(kvtier.UsageError, match=rf"{arg} {value} is out of range"):
        kvtier.TierBuilder().geometry(**kw)


def test_block_ids_as_torch_and_numpy_arrays(tmp_path):
    np = pytest.importorskip("numpy")
    t = kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")
    for x in t:
        x.normal_()
    with small_tier(tmp_path, t) as tier:
        # vLLM's block tables are int32 tensors: block ids come as tensors.
        tier.wait(tier.submit_store([1, 2], torch.tensor([1, 4], dtype=torch.int32))).raise_for_failure()
        tier.wait(tier.submit_load([1, 2], np.array([0, 2]))).raise_for_failure()
        for x in t:
            assert torch.equal(x[:, 0], x[:, 1]) and torch.equal(x[:, 2], x[:, 4])
        with pytest.raises(kvtier.UsageError, match="block 1 is -1, out of range"):
            tier.submit_store([3, 4], torch.tensor([0, -1]))
        with pytest.raises(kvtier.UsageError, match="block 0 is -2, out of range"):
            tier.submit_load([1], [-2])
        with pytest.raises(TypeError, match="block 0 is a float"):
            tier.submit_load([1], [0.5])
        with pytest.raises(kvtier.UsageError, match="out of range: the registered KV memory has 6"):
            tier.submit_load([1], torch.tensor([6]))


def test_keys_of_every_kind_and_their_misuse(tmp_path):
    with small_tier(tmp_path) as tier:
        # Empty lists: nothing to look up; a job of nothing is refused.
        assert tier.lookup([]) == 0
        with pytest.raises(kvtier.UsageError, match="at least one key"):
            tier.submit_store([], [])
        # bytes and ints are different keys (an int is its 8 little-endian bytes).
        tier.wait(tier.submit_store([5, b"five"], [0, 1])).raise_for_failure()
        assert tier.lookup([5, b"five"]) == 2
        assert tier.lookup([(5).to_bytes(8, "little")]) == 1
        assert tier.lookup([b"\x05"]) == 0
        # The same key twice in one store: stored once, from the first block.
        r = tier.wait(tier.submit_store([b"d", b"d"], [2, 3]))
        assert r.outcomes == ["done", "already_stored"], r.outcomes
        with pytest.raises(kvtier.UsageError, match="key 0 is -1, out of range"):
            tier.lookup([-1])
        with pytest.raises(kvtier.UsageError, match=r"key 1 is 18446744073709551616, out of range"):
            tier.lookup([1, 2**64])
        with pytest.raises(TypeError, match="key 0 is a str"):
            tier.lookup(["a-hash"])
        # A bool is an int to Python, but never a content hash: True would
        # have been key 1.
        with pytest.raises(TypeError, match="key 1 is True, a bool"):
            tier.lookup([5, True])
        with pytest.raises(TypeError, match="key 0 is False, a bool"):
            tier.submit_store([False], [0])
        with pytest.raises(TypeError, match="list of keys"):
            tier.lookup(b"one-key")


def test_numpy_buffers_of_another_float_dtype_are_refused(tmp_path):
    pytest.importorskip("numpy")
    # numpy has no bfloat16: a float16 array is what a careless user has.
    t = [x.view(torch.float16).numpy() for x in kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")]
    with pytest.raises(kvtier.UsageError, match="torch.float16 but the model's KV dtype is bfloat16"):
        small_tier(tmp_path / "a", t)
    # Raw bytes or integers are registered as they are; float16 for a
    # float16 model too.
    t = [x.view(torch.int16).numpy() for x in kv_tensors(2, 2, 64, torch.bfloat16, 16, "per_layer")]
    with small_tier(tmp_path / "b", t) as tier:
        assert tier.memory_blocks == BLOCKS
    t = [x.numpy() for x in kv_tensors(2, 2, 64, torch.float16, 16, "per_layer")]
    with small_tier(tmp_path / "c", t, dtype="float16") as tier:
        assert tier.memory_blocks == BLOCKS
