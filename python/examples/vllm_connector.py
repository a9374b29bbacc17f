"""vLLM with kvtier's connector, enabled by configuration alone: a prompt's
KV is stored in a kvtier pool; a fresh engine (run this again: a new
process, nothing in vLLM's own prefix cache) restores the prefix from the
pool layer by layer instead of recomputing it. Runs as written:

    python python/examples/vllm_connector.py MODEL_DIR [POOL_DIR]
"""

import sys
import tempfile

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig


def main() -> None:
    model = sys.argv[1]
    pool_dir = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="kvtier-vllm-")
    llm = LLM(
        model=model,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"pool_dir": pool_dir, "capacity": "1g"}),
        max_model_len=512,
        skip_tokenizer_init=True,  # token ids in and out; drop it to send text
        enforce_eager=True,  # starts in seconds (no graph capture)
        seed=0,
    )
    prompt = [(i * 7919) % 500 + 3 for i in range(400)]  # a long shared prefix
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(max_tokens=8, temperature=0, detokenize=False),
                       use_tqdm=False)[0]
    # A fresh engine's cached tokens came from kvtier (vLLM's own prefix
    # cache starts empty in every process).
    print(f"tokens {list(out.outputs[0].token_ids)}; "
          f"{out.num_cached_tokens} prompt tokens restored from {pool_dir}")
    llm.llm_engine.engine_core.shutdown()  # closes the pool: the next run opens it


if __name__ == "__main__":
    main()
