"""One vLLM engine run, in its own process (tests/test_vllm.py starts it):
a tiny llama with dummy weights on CPU, greedy, token ids in and out.

    python vllm_engine.py OUT.json [POOL_DIR STATS_PATH]

Prompts come from the KVTIER_TEST_PROMPTS environment variable (JSON list
of token-id lists), the model directory from KVTIER_TEST_MODEL (its
safetensors if present, else dummy weights). With POOL_DIR, kvtier's connector is enabled by config (POOL_DIR "-": none,
KVTIER_TEST_EXTRA='{"service": SOCKET}' names a kvtier serve instead).
KVTIER_TEST_DTYPE, KVTIER_TEST_KV_CACHE_DTYPE (e.g. fp8), KVTIER_TEST_BLOCK_SIZE: the
engine's dtype, KV cache dtype and block size.
KVTIER_TEST_LLM_KW: more keyword arguments of LLM(...) as JSON (e.g.
'{"enable_prefix_caching": false, "max_num_batched_tokens": 128}').
KVTIER_TEST_TP: tensor_parallel_size (ranks in worker processes; on CPU
each rank's threads are bound to one core: VLLM_CPU_OMP_THREADS_BIND).
"""

import json
import os
import sys
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    out = sys.argv[1]
    kw = {}
    if len(sys.argv) > 2:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector",
            kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="fail",
            kv_connector_extra_config={
                # "-": no pool of its own (KVTIER_TEST_EXTRA names a service).
                **({"pool_dir": sys.argv[2]} if sys.argv[2] != "-" else {}),
                "capacity": "256m",
                "staging_blocks": 16,
                "stats_path": sys.argv[3],
                # More extra config for a run by hand, e.g. the HBM path's
                # host double: '{"test_only_staged_host_double": true}'.
                **json.loads(os.environ.get("KVTIER_TEST_EXTRA", "{}")),
            },
        )
    model = os.environ.get("KVTIER_TEST_MODEL", os.path.join(HERE, "tiny-llama"))
    weights = os.path.exists(os.path.join(model, "model.safetensors"))
    t = time.time()
    llm = LLM(
        model=model,
        load_format="auto" if weights else "dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        **({"block_size": int(os.environ["KVTIER_TEST_BLOCK_SIZE"])}
           if os.environ.get("KVTIER_TEST_BLOCK_SIZE") else {}),
        **({"dtype": os.environ["KVTIER_TEST_DTYPE"]} if os.environ.get("KVTIER_TEST_DTYPE") else {}),
        **({"kv_cache_dtype": os.environ["KVTIER_TEST_KV_CACHE_DTYPE"]}
           if os.environ.get("KVTIER_TEST_KV_CACHE_DTYPE") else {}),
        **({"tensor_parallel_size": int(os.environ["KVTIER_TEST_TP"]),
            "distributed_executor_backend": "mp"} if os.environ.get("KVTIER_TEST_TP") else {}),
        **json.loads(os.environ.get("KVTIER_TEST_LLM_KW", "{}")),
        **kw,
    )
    init_s = time.time() - t
    prompts = json.loads(os.environ["KVTIER_TEST_PROMPTS"])
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    res = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "cached": [o.num_cached_tokens for o in outs],
        "init_s": init_s,
        "total_s": time.time() - t,
    }
    # Shut the engine down (the worker's connector closes its pool) before
    # reporting, so the next engine finds the pool free and complete.
    llm.llm_engine.engine_core.shutdown()
    with open(out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
