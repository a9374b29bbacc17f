"""Time to first token: recompute a prompt, or restore its prefix from kvtier
layer by layer while the suffix's layers run, or find the prefix in HBM.

A llama-shaped model with random bf16 weights (transformers' LlamaForCausalLM
when transformers imports, its weights used by the explicit forward below),
prefixes of --prefixes tokens and a --suffix-token suffix:

  (a) recompute: the whole prompt (prefix + suffix) in one causal prefill;
  (b) kvtier:    the prefix's KV blocks loaded from the pool into the model's
                 paged KV cache (per-layer tensors registered with kvtier,
                 blocks permuted as an engine's block table leaves them),
                 submitted at t0; layer l's attention waits on the GPU for
                 layer l (`stream_wait_layer`), the host never waits;
  (c) in HBM:    the same suffix prefill on the same cache, already filled
                 (the ceiling of (b)).

Per case: medians of --rounds rounds (after one warm-up round), the stall of
each layer's wait in (b) (CUDA events around it) against the same points in
(c), the pool's read bandwidth in the same rounds (a load alone, no compute),
and the last token's logits: (b) must equal (c) bit for bit (same bytes, same
kernels) and both must match (a) within bf16 tolerance.

Runs on a GPU (the default when torch.cuda is available) or, to check the
script without one, on the CPU with kvtier's staged-path host double
(`--device cpu --model tiny`): the same code, host waits instead of stream
waits, no timings worth reading.

Writes one JSON per (model, prefix) and FIG lines to stdout as it goes.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kvtier

SHAPES = {
    # hidden, heads, kv heads, head_dim, intermediate, layers, vocab
    "llama3-8b": (4096, 32, 8, 128, 14336, 32, 128256),
    "llama3-70b": (8192, 64, 8, 128, 28672, 80, 128256),
    "tiny": (256, 4, 2, 64, 512, 4, 1000),
}
BS = 16  # tokens per KV block: vLLM's default


def fig(*a):
    print("FIG", *a, flush=True)


def hf_config(name, layers):
    h, heads, kvh, hd, inter, _, vocab = SHAPES[name]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kvh,
        "head_dim": hd,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
    }


class Weights:
    """The model's tensors, from transformers' LlamaForCausalLM when it
    imports (so (a) can also be checked against transformers' own forward),
    else drawn here with the same initialisation."""

    def __init__(self, cfg, dev, use_hf):
        self.cfg = cfg
        self.hf = None
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        heads, kvh, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        try:
            if not use_hf:
                raise RuntimeError("not asked for (--hf-models)")
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            prev = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                with torch.device(dev):
                    m = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
            finally:
                torch.set_default_dtype(prev)
            m = m.to(dtype=torch.bfloat16).eval()
            self.hf = m
            L = m.model.layers
            self.embed = m.model.embed_tokens.weight
            self.norm = m.model.norm.weight
            self.head = m.lm_head.weight
            self.layers = [
                (l.input_layernorm.weight, l.self_attn.q_proj.weight, l.self_attn.k_proj.weight,
                 l.self_attn.v_proj.weight, l.self_attn.o_proj.weight, l.post_attention_layernorm.weight,
                 l.mlp.gate_proj.weight, l.mlp.up_proj.weight, l.mlp.down_proj.weight)
                for l in L
            ]
            rot = m.model.rotary_emb
            self.inv_freq = rot.inv_freq.to(dev, torch.float32)
            self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
            self.source = "transformers LlamaForCausalLM"
        except Exception as e:  # no transformers, or an API it changed: own weights
            self.hf = None
            self.source = f"own weights (transformers: {type(e).__name__}: {e})"
            g = torch.Generator(device=dev).manual_seed(0)

            def w(*shape):
                return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(torch.bfloat16)

            one = lambda n: torch.ones(n, device=dev, dtype=torch.bfloat16)  # noqa: E731
            self.embed, self.norm, self.head = w(cfg["vocab_size"], h), one(h), w(cfg["vocab_size"], h)
            self.layers = [
                (one(h), w(heads * hd, h), w(kvh * hd, h), w(kvh * hd, h), w(h, heads * hd), one(h),
                 w(inter, h), w(inter, h), w(h, inter))
                for _ in range(cfg["num_hidden_layers"])
            ]
            theta = cfg["rope_theta"]
            self.inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd))
            self.rope_scale = 1.0


def rms(x, w, eps):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return w * (x.float() * torch.rsqrt(v + eps)).to(x.dtype)


def rope(x, cos, sin):
    # transformers' convention: rotate the two halves of head_dim.
    d = x.shape[-1] // 2
    r = torch.cat((-x[..., d:], x[..., :d]), dim=-1)
    return (x * cos + r * sin).to(x.dtype)


try:
    from torch.nn.attention.bias import causal_lower_right
except ImportError:  # older torch: an explicit mask
    causal_lower_right = None


def attention(q, k, v):
    """q (1, H, Lq, D); k, v (1, KVH, Lk, D) with Lk >= Lq; the queries are
    the last Lq positions (causal, aligned at the bottom right)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    if lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if causal_lower_right is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk))
    mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@torch.no_grad()
def forward(W, ids, pos0, prefix_kv=None, wait=None, capture=None, marks=None):
    """Last-token logits (float32) of `ids` at positions pos0.. . prefix_kv(l)
    gives layer l's cached K, V (tokens, KVH, D) for positions 0..pos0-1;
    wait(l) is called before layer l's attention reads them; capture(l, k, v)
    receives the layer's new K, V; marks(l, where) records events."""
    cfg = W.cfg
    heads, kvh, hd, eps = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    n = ids.shape[0]
    pos = torch.arange(pos0, pos0 + n, device=ids.device, dtype=torch.float32)
    ang = torch.outer(pos, W.inv_freq)
    ang = torch.cat((ang, ang), dim=-1)
    cos = (ang.cos() * W.rope_scale).to(torch.bfloat16)[None, :, None, :]
    sin = (ang.sin() * W.rope_scale).to(torch.bfloat16)[None, :, None, :]
    x = F.embedding(ids, W.embed)[None]
    for l, (w_in, wq, wk, wv, wo, w_post, wg, wu, wd) in enumerate(W.layers):
        h = rms(x, w_in, eps)
        q = rope((h @ wq.T).view(1, n, heads, hd), cos, sin)
        k = rope((h @ wk.T).view(1, n, kvh, hd), cos, sin)
        v = (h @ wv.T).view(1, n, kvh, hd)
        if capture is not None:
            capture(l, k[0], v[0])
        if marks is not None:
            marks(l, 0)
        if wait is not None:
            wait(l)
        if marks is not None:
            marks(l, 1)
        if prefix_kv is not None:
            pk, pv = prefix_kv(l)
            k = torch.cat((pk[None], k), dim=1)
            v = torch.cat((pv[None], v), dim=1)
        o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + o.transpose(1, 2).reshape(1, n, heads * hd) @ wo.T
        h = rms(x, w_post, eps)
        x = x + (F.silu(h @ wg.T) * (h @ wu.T)) @ wd.T
    return (rms(x[:, -1:], W.norm, eps) @ W.head.T).float()[0, -1]


def compare(a, b):
    d = (a - b).abs().max().item()
    cos = F.cosine_similarity(a[None], b[None]).item()
    top_a, top_b = a.topk(5).indices.tolist(), b.topk(5).indices.tolist()
    return {"max_abs_diff": d, "max_abs": a.abs().max().item(), "cosine": cos,
            "top5_overlap": len(set(top_a) & set(top_b)), "top1_equal": top_a[0] == top_b[0]}


def within_bf16(c):
    # Two prefills that differ only in how attention is split (one causal
    # pass vs cached prefix + suffix) differ by bf16 rounding, not more.
    return c["cosine"] >= 0.999 and c["max_abs_diff"] <= 0.05 * max(c["max_abs"], 1e-3)


def choose_layers(name, dev, max_prefix, want):
    full = SHAPES[name][5]
    if want:
        return min(want, full)
    if dev.type != "cuda":
        return full
    h, heads, kvh, hd, inter, _, vocab = SHAPES[name]
    per_layer = 2 * (h * heads * hd * 2 + 2 * h * kvh * hd + 3 * h * inter)  # bf16 weights
    per_layer += max_prefix * kvh * hd * 2 * 2  # the registered KV cache
    fixed = 2 * 2 * vocab * h  # embedding + lm_head
    free, _ = torch.cuda.mem_get_info(dev)
    # Working set of a 32K-token prefill (MLP intermediates, a layer's
    # expanded K/V, the capture), with room to spare.
    reserve = 24 << 30
    return max(1, min(full, int((free - fixed - reserve) // per_layer)))


class Tier:
    """kvtier over the model's paged KV cache: one (2, blocks, BS, KVH, D)
    tensor per layer ("per_layer" layout, as vLLM's flash-attention cache)."""

    def __init__(self, pool_dir, cfg, dev, blocks):
        os.makedirs(pool_dir, exist_ok=True)
        with open(os.path.join(pool_dir, "config.json"), "w") as f:
            json.dump(cfg, f)
        L, kvh, hd = cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.kv = [torch.zeros(2, blocks, BS, kvh, hd, device=dev, dtype=torch.bfloat16) for _ in range(L)]
        block_bytes = L * 2 * BS * kvh * hd * 2
        capacity = blocks * block_bytes * 5 // 4 + (256 << 20)
        b = (kvtier.TierBuilder().directory(os.path.join(pool_dir, "pool")).capacity(capacity)
             .model(os.path.join(pool_dir, "config.json"), block_size=BS).engine("uring"))
        if dev.type != "cuda":
            b = b.test_only_staged_host_double()
        self.tier = b.kv_memory(self.kv, layout="per_layer").build()
        self.block_bytes = block_bytes
        self.dev = dev

    def clear(self):
        for t in self.kv:
            t.zero_()

    def views(self, blocks_t):
        # The prefix's K, V of layer l in token order, gathered through the
        # block table (as a paged-attention kernel reads them).
        def prefix_kv(l):
            t = self.kv[l]
            kvh, hd = t.shape[3], t.shape[4]
            return (t[0].index_select(0, blocks_t).view(-1, kvh, hd),
                    t[1].index_select(0, blocks_t).view(-1, kvh, hd))
        return prefix_kv


def median(xs):
    return statistics.median(xs) if xs else None


def run_model(args, name, dev, out):
    # Longest first: its (c) reads the captured KV itself; a shorter prefix's
    # (c) then reads blocks that the longer case's loads restored and its
    # (b) == (c) check verified.
    prefixes = sorted(args.prefixes, reverse=True)
    max_prefix = max(prefixes)
    nl = choose_layers(name, dev, max_prefix, args.layers.get(name))
    cfg = hf_config(name, nl)
    t0 = time.perf_counter()
    W = Weights(cfg, dev, name in args.hf_models)
    sync(dev)
    fig(f"ttft {name}: {nl} of {SHAPES[name][5]} layers, weights from {W.source}, built in {time.perf_counter() - t0:.1f} s")
    g = torch.Generator().manual_seed(1)
    vocab = cfg["vocab_size"]
    prompt = torch.randint(0, vocab, (max_prefix,), generator=g).to(dev)
    suffix = torch.randint(0, vocab, (args.suffix,), generator=g).to(dev)
    nblocks = max_prefix // BS
    # The engine's block table: the prefix's blocks are wherever the cache
    # had room, not 0..n-1.
    table = torch.randperm(nblocks, generator=g)
    T = Tier(os.path.join(args.dir, name), cfg, dev, nblocks)
    keys = [f"{name}-prefix-{i}".encode() for i in range(nblocks)]

    # The prefix's KV: computed once (the first request), stored to the pool.
    t0 = time.perf_counter()

    table_dev = table.to(dev)

    def capture(l, k, v):
        T.kv[l][0][table_dev] = k.reshape(nblocks, BS, k.shape[1], k.shape[2])
        T.kv[l][1][table_dev] = v.reshape(nblocks, BS, v.shape[1], v.shape[2])

    forward(W, prompt, 0, capture=capture)
    sync(dev)
    t_fill = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = T.tier.wait(T.tier.submit_store(keys, table.tolist()))
    t_store = time.perf_counter() - t0
    if not r.ok:
        raise RuntimeError(f"storing the prefix failed: {r}")
    store_bytes = nblocks * T.block_bytes
    fig(f"ttft {name}: prefix {max_prefix} tokens computed in {t_fill:.2f} s, stored {store_bytes / 2**30:.2f} GiB in {t_store:.2f} s ({store_bytes / t_store / 1e9:.2f} GB/s)")

    results = []
    for P in prefixes:
        if time.perf_counter() > args.deadline:
            fig(f"ttft {name} prefix={P} SKIPPED(no time)")
            continue
        pb = P // BS
        blocks = table[:pb].tolist()
        blocks_t = table[:pb].to(dev)
        pkeys = keys[:pb]
        prefix_kv = T.views(blocks_t)
        full = torch.cat((prompt[:P], suffix))
        nbytes = pb * T.block_bytes
        rec = {"model": name, "b_wait": args.b_wait, "layers": nl, "layers_full": SHAPES[name][5], "prefix": P, "suffix": args.suffix,
               "block_size": BS, "kv_bytes": nbytes, "device": str(dev), "weights": W.source,
               "a_s": [], "b_s": [], "c_s": [], "load_alone_s": [], "b_stall_ms": [], "c_stall_ms": [],
               "b_first_stall_ms": [], "b_stalls_ms": None}
        ref_c = None
        logits_a = None
        for rnd in range(args.rounds + 1):
            # (c) the prefix in HBM (filled by the capture, then by (b)).
            m = Marks(dev, nl)
            sync(dev)
            t0 = time.perf_counter()
            lc = forward(W, suffix, P, prefix_kv=prefix_kv, marks=m.mark)
            sync(dev)
            tc = time.perf_counter() - t0
            if ref_c is None:
                ref_c = lc
            # (b) restore from the pool while the suffix runs.
            T.clear()
            mb = Marks(dev, nl)
            sync(dev)
            t0 = time.perf_counter()
            got = T.tier.lookup_and_pin(pkeys)
            if got != pb:
                raise RuntimeError(f"lookup found {got} of {pb} prefix blocks")
            job = T.tier.submit_load(pkeys, blocks)
            stream = torch.cuda.current_stream().cuda_stream if dev.type == "cuda" else None

            def wait(l):
                if stream is None or args.b_wait == "host" or not T.tier.stream_wait_layer(job, l, stream):
                    T.tier.wait_layer(job, l)

            lb = forward(W, suffix, P, prefix_kv=prefix_kv, wait=wait, marks=mb.mark)
            sync(dev)
            tb = time.perf_counter() - t0
            r = T.tier.wait(job)
            T.tier.unpin(pkeys)
            if not r.ok:
                raise RuntimeError(f"the prefix load failed: {r}")
            if not torch.equal(lb, ref_c):
                c = compare(ref_c, lb)
                raise RuntimeError(f"(b) logits differ from (c)'s (the restored prefix is not the stored one): {c}")
            # The pool's read bandwidth, same round: the load alone.
            sync(dev)
            t0 = time.perf_counter()
            assert T.tier.lookup_and_pin(pkeys) == pb
            r = T.tier.wait(T.tier.submit_load(pkeys, blocks))
            tl = time.perf_counter() - t0
            T.tier.unpin(pkeys)
            if not r.ok:
                raise RuntimeError(f"the prefix load failed: {r}")
            # (a) recompute the whole prompt.
            sync(dev)
            t0 = time.perf_counter()
            la = forward(W, full, 0)
            sync(dev)
            ta = time.perf_counter() - t0
            logits_a = la
            stalls_b, stalls_c = mb.stalls(), m.stalls()
            if rnd == 0:
                continue  # warm-up: cuBLAS handles, allocator, first loads
            rec["a_s"].append(ta)
            rec["b_s"].append(tb)
            rec["c_s"].append(tc)
            rec["load_alone_s"].append(tl)
            if stalls_b is not None:
                rec["b_stall_ms"].append(sum(stalls_b))
                rec["c_stall_ms"].append(sum(stalls_c))
                rec["b_first_stall_ms"].append(stalls_b[0])
                rec["b_stalls_ms"] = stalls_b
            fig(f"ttft {name} prefix={P} round {rnd}: a={ta * 1e3:.1f} ms b={tb * 1e3:.1f} ms c={tc * 1e3:.1f} ms load_alone={tl * 1e3:.1f} ms ({nbytes / tl / 1e9:.2f} GB/s)")
        ab = compare(logits_a, ref_c)
        rec["logits_b_vs_a"] = ab
        rec["logits_b_within_bf16_of_a"] = within_bf16(ab)
        rec["logits_b_equal_c"] = True  # checked every round above (raises otherwise)
        if W.hf is not None and P == prefixes[-1] and args.hf_check:
            try:
                with torch.no_grad():
                    try:
                        hl = W.hf(full[None], logits_to_keep=1, use_cache=False).logits[0, -1].float()
                    except TypeError:
                        hl = W.hf(full[None], use_cache=False).logits[0, -1].float()
                c = compare(hl, logits_a)
                rec["logits_a_vs_transformers"] = c
                rec["logits_a_within_bf16_of_transformers"] = within_bf16(c)
                fig(f"ttft {name} prefix={P}: own forward vs transformers' forward: cosine {c['cosine']:.5f}, max |diff| {c['max_abs_diff']:.4f} of {c['max_abs']:.3f}, top1 equal {c['top1_equal']}")
            except Exception as e:
                rec["logits_a_vs_transformers"] = f"{type(e).__name__}: {e}"
                fig(f"ttft {name} prefix={P}: transformers' forward failed: {type(e).__name__}: {e}")
        summarize(rec, nl)
        results.append(rec)
        with open(os.path.join(out, f"ttft-{name}-{P}.json"), "w") as f:
            json.dump(rec, f, indent=1)
    T.tier.close()
    del T, W
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return results


def summarize(rec, nl):
    a, b, c, la = (median(rec[k]) for k in ("a_s", "b_s", "c_s", "load_alone_s"))
    if a is None:
        return
    bw = rec["kv_bytes"] / la
    rec["median"] = {"a_ms": a * 1e3, "b_ms": b * 1e3, "c_ms": c * 1e3, "load_alone_ms": la * 1e3,
                     "read_GBps": bw / 1e9, "b_over_a": b / a, "bubble_per_layer_ms": (b - c) * 1e3 / nl}
    # Arithmetic, not a measurement: (b) on a disk of `ssd_GBps` (x4 SSDs at
    # 7 GB/s), by the same per-layer pipeline: the first layer's bytes, then
    # each layer the slower of its load and its compute.
    per_layer_bytes = rec["kv_bytes"] / nl
    per_layer_compute = c / nl
    est = {}
    for gbps in (bw / 1e9, 28.0):
        load_l = per_layer_bytes / (gbps * 1e9)
        est[f"{gbps:.2f}"] = (load_l + (nl - 1) * max(load_l, per_layer_compute) + per_layer_compute) * 1e3
    rec["arithmetic_b_ms_at_GBps"] = est
    fig(f"ttft {rec['model']} ({nl} layers) prefix={rec['prefix']}: median a={a * 1e3:.1f} ms, b={b * 1e3:.1f} ms ({b / a:.2f}x a), c={c * 1e3:.1f} ms, bubble/layer={(b - c) * 1e3 / nl:.2f} ms, read {bw / 1e9:.2f} GB/s; logits b vs a cosine {rec['logits_b_vs_a']['cosine']:.5f} (within bf16: {rec['logits_b_within_bf16_of_a']}), b == c bitwise; arithmetic b at 28 GB/s: {est['28.00']:.1f} ms")


class Marks:
    """CUDA events before and after each layer's wait: the stall of layer l
    is the time between them on the GPU's clock."""

    def __init__(self, dev, layers):
        self.ev = None
        if dev.type == "cuda":
            self.ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(layers)]

    def mark(self, l, where):
        if self.ev is not None:
            self.ev[l][where].record()

    def stalls(self):
        if self.ev is None:
            return None
        return [e[0].elapsed_time(e[1]) for e in self.ev]


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3-8b,llama3-70b")
    p.add_argument("--prefixes", default="8192,32768")
    p.add_argument("--suffix", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--layers", default="", help="cap layers per model, e.g. llama3-70b=40")
    p.add_argument("--dir", required=True, help="pool directory (a real disk)")
    p.add_argument("--out", default=".")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip cases that would start after this")
    p.add_argument("--b-wait", choices=("stream", "host"), default="stream",
                   help="(b)'s per-layer wait: the compute stream waits on the GPU for the layer's "
                        "copy (stream_wait_layer), or the host waits for the layer (wait_layer)")
    p.add_argument("--no-hf-check", dest="hf_check", action="store_false")
    p.add_argument("--hf-models", default="llama3-8b,tiny",
                   help="models built as transformers' LlamaForCausalLM (and checked against its forward); "
                        "the others get weights drawn here (faster for the large ones)")
    args = p.parse_args()
    args.prefixes = [int(x) for x in args.prefixes.split(",")]
    args.hf_models = set(args.hf_models.split(","))
    for x in args.prefixes:
        if x % BS:
            p.error(f"--prefixes: {x} is not a multiple of the block size {BS}")
    args.layers = {k: int(v) for k, v in (kv.split("=") for kv in args.layers.split(",") if kv)}
    args.deadline = time.perf_counter() + args.budget_s
    # A hang (a wait that never ends) shows where it is: every Python
    # thread's stack every 60 s, on stderr.
    import faulthandler

    faulthandler.dump_traceback_later(60, repeat=True)
    dev = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    if dev.type == "cuda":
        fig(f"ttft gpu={torch.cuda.get_device_name(dev)} torch={torch.__version__}")
    failed = 0
    for name in args.models.split(","):
        if time.perf_counter() > args.deadline:
            fig(f"ttft {name} SKIPPED(no time)")
            continue
        try:
            run_model(args, name, dev, args.out)
        except Exception as e:
            failed += 1
            import traceback

            traceback.print_exc()
            fig(f"ttft {name} FAILED: {type(e).__name__}: {e}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
