#!/usr/bin/env python3
"""kvtier-profile's torch harness: time a model's decoder layers on a GPU.

`kvtier-profile --compute torch` runs this; it can also be run by hand and its
output fed to `kvtier-profile --compute trace FILE`.

What it does:
  * builds the model's decoder layers from a Hugging Face config.json with
    random bf16 weights (transformers' own layer classes: Llama, Qwen3, GLM, ...);
  * for every (input, prefix) grid point, a prefill of `input` new tokens
    over `prefix` cached tokens through the built layers, captured once as a
    CUDA graph and timed by replaying it between CUDA events (median over
    --repeats after --warmup replays): GPU time, not Python launch time,
    which per-layer eager timing measured instead (on an H100 it made a
    llama3-8b decode step read 39 ms; GPU time is a few ms). A layer's time
    is the graph's time over the layers in it. --timing eager keeps the old
    per-layer eager timing (for a torch that cannot capture);
  * for every decode context C, one decode step (1 new token over C-1 cached),
    timed the same way;
  * asserts the timed attention ran: once per layer per pass, over exactly
    prefix + input keys;
  * writes the kvtier-trace/1 JSON (see profiler/src/trace.rs) to --out or stdout.

The KV cache is a preallocated buffer, as in a serving engine's paged cache:
the layer's new K/V are copied into it (vLLM's reshape_and_cache) and
attention runs over the prefix plus the new tokens, causally aligned to the
bottom right (new token i sees the whole prefix and new tokens <= i):
  * flash_attn.flash_attn_func when flash-attn is installed (what vLLM's
    FlashAttention backend runs; GQA native);
  * else torch SDPA with torch.nn.attention.bias.causal_lower_right, GQA
    through SDPA's enable_gqa (torch >= 2.5; KV heads repeated otherwise).
--attention picks one explicitly.

Only `--layers` distinct layers are built (by default as many as fit in half
the free GPU memory, at most 8): layer l of the model runs built layer
l % layers. All decoder layers of these models have the same shape, so this
changes which weights are read, not how long a layer takes; it keeps 70B-class
models on one GPU. Every layer input is the same random hidden state (random
weights would otherwise drive activations to inf after a few layers; the
kernels' time does not depend on the values).

Exit status: 0 done; 2 bad arguments or config; 3 torch, transformers or CUDA
is missing (kvtier-profile reports it as such).
"""

import argparse
import json
import math
import statistics
import sys
import time


def fail(code, msg):
    print(f"torch_harness: {msg}", file=sys.stderr)
    sys.exit(code)


def int_list(s):
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        fail(2, f"{s!r} is not a comma-separated list of integers")
    if not out or any(v < 0 for v in out):
        fail(2, f"{s!r}: give at least one non-negative integer")
    return out


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None,
                    help="Hugging Face config.json of the model (--check: a tiny built-in llama if absent)")
    ap.add_argument("--name", default=None, help="model name written into the trace")
    ap.add_argument("--inputs", default=None, help="input lengths, e.g. 512,1024")
    ap.add_argument("--prefixes", default=None, help="prefix lengths, e.g. 0,2048")
    ap.add_argument("--contexts", default=None, help="decode context lengths, e.g. 1024,4096")
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct layers to build (0: as many as fit in half the free memory, at most 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes per grid point")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per grid point (median taken)")
    ap.add_argument("--timing", choices=["graph", "eager"], default="graph",
                    help="graph: replay a CUDA graph of the layers (GPU time); eager: events around each layer")
    ap.add_argument("--attention", choices=["auto", "flash", "sdpa"], default="auto")
    ap.add_argument("--out", default=None, help="write the trace here (default: stdout)")
    ap.add_argument("--check", action="store_true",
                    help="check torch, transformers and CUDA, and the timed attention against a reference, then exit")
    args = ap.parse_args()
    if not args.check and (args.config is None or args.inputs is None or args.prefixes is None
                           or args.contexts is None):
        fail(2, "give --config, --inputs, --prefixes and --contexts (or --check alone)")
    return args


def import_stack(which_attention):
    try:
        import torch
    except ImportError as e:
        fail(3, f"torch is not installed ({e}); pip install torch (with CUDA)")
    if not torch.cuda.is_available():
        fail(3, f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import transformers
    except ImportError as e:
        fail(3, f"transformers is not installed ({e}); pip install 'transformers>=4.48'")
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: F401  (4.48+)
    except ImportError:
        fail(3, f"transformers {transformers.__version__} is too old: the harness needs >= 4.48 "
                "(pluggable attention functions)")
    flash = None
    if which_attention in ("auto", "flash"):
        try:
            from flash_attn import flash_attn_func
            flash = flash_attn_func
        except ImportError as e:
            if which_attention == "flash":
                fail(3, f"--attention flash: flash-attn is not installed ({e})")
    return torch, transformers, flash


class KvState:
    """The preallocated cache the custom attention writes into and reads from."""
    k = None  # (1, T, kv_heads, head_dim)
    v = None
    prefix = 0
    # What the attention saw, so a pass that skipped it (or attended over the
    # wrong keys) fails instead of timing something else.
    calls = 0
    keys_seen = -1


def make_attention(torch, flash):
    import torch.nn.functional as F
    lower_right = None
    try:
        from torch.nn.attention.bias import causal_lower_right
        lower_right = causal_lower_right
    except ImportError:
        pass
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2] if x.isdigit())
    gqa_kw = version >= (2, 5)  # SDPA's enable_gqa

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query: (1, H, q, d); key/value: (1, kvH, q, d), the new tokens only.
        p = KvState.prefix
        q_len = query.shape[2]
        total = p + q_len
        KvState.calls += 1
        KvState.keys_seen = total
        KvState.k[:, p:total].copy_(key.transpose(1, 2))
        KvState.v[:, p:total].copy_(value.transpose(1, 2))
        k = KvState.k[:, :total]
        v = KvState.v[:, :total]
        if flash is not None:
            out = flash(query.transpose(1, 2), k, v, softmax_scale=scaling, causal=True)
            return out, None
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        groups = query.shape[1] // k.shape[1]
        if q_len == 1:
            if groups > 1 and gqa_kw:
                out = F.scaled_dot_product_attention(query, k, v, scale=scaling, enable_gqa=True)
            else:
                if groups > 1:
                    k = k.repeat_interleave(groups, dim=1)
                    v = v.repeat_interleave(groups, dim=1)
                out = F.scaled_dot_product_attention(query, k, v, scale=scaling)
        else:
            gqa = {}
            if groups > 1 and gqa_kw:
                gqa = {"enable_gqa": True}
            elif groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            if p == 0:
                out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling, **gqa)
            elif lower_right is not None:
                mask = lower_right(q_len, total)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, **gqa)
            elif q_len * total <= (1 << 28):
                if gqa:
                    k = k.repeat_interleave(groups, dim=1)
                    v = v.repeat_interleave(groups, dim=1)
                mask = torch.ones(q_len, total, dtype=torch.bool, device=query.device).tril(diagonal=p)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
            else:
                fail(3, "this torch has no causal_lower_right and the mask would be too large; "
                        "install flash-attn or torch >= 2.3")
        return out.transpose(1, 2).contiguous(), None

    return attention


def load_config(transformers, path):
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        fail(2, f"{path}: cannot read the config ({e})")
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
        top = raw
        raw = dict(raw["text_config"])
        raw.setdefault("torch_dtype", top.get("torch_dtype", "bfloat16"))
    model_type = raw.get("model_type")
    if model_type == "chatglm":
        fail(2, f"{path}: model_type chatglm is remote code, not in transformers; use the HF-format "
                "config (model_type glm, e.g. THUDM/glm-4-9b-hf) or kvtier-profile's glm4-9b preset")
    if not model_type:
        fail(2, f"{path}: no model_type; the harness builds layers through transformers' AutoConfig")
    if "num_hidden_layers" not in raw:
        fail(2, f"{path}: no num_hidden_layers")
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError) as e:
        fail(2, f"{path}: transformers {transformers.__version__} cannot build model_type {model_type!r}: {e}")
    return cfg, raw


def layer_bytes(cfg):
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    kvh = getattr(cfg, "num_key_value_heads", None) or heads
    inter = cfg.intermediate_size
    return 2 * (h * (heads * hd + 2 * kvh * hd) + heads * hd * h + 3 * h * inter)


TINY_CONFIG = {
    # A two-layer llama for --check without --config: GQA (4 query heads over
    # 2 KV heads), small enough to build anywhere in a second.
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


def check_attention(torch, attention, kv_heads, heads, head_dim):
    """The timed attention against a float32 reference: prefill over a
    prefix, prefill without one, and a decode step."""
    dev = "cuda"
    for prefix, q_len in ((64, 32), (0, 48), (95, 1)):
        total = prefix + q_len
        KvState.k = torch.randn((1, total, kv_heads, head_dim), dtype=torch.bfloat16, device=dev)
        KvState.v = torch.randn_like(KvState.k)
        KvState.prefix = prefix
        q = torch.randn((1, heads, q_len, head_dim), dtype=torch.bfloat16, device=dev)
        k_new = KvState.k[:, prefix:].transpose(1, 2).clone()
        v_new = KvState.v[:, prefix:].transpose(1, 2).clone()
        KvState.k[:, prefix:].zero_()  # the attention must write the new keys itself
        KvState.v[:, prefix:].zero_()
        scale = head_dim ** -0.5
        out, _ = attention(None, q, k_new, v_new, None, scaling=scale)
        k = torch.cat([KvState.k[:, :prefix].transpose(1, 2), k_new], dim=2).float()
        v = torch.cat([KvState.v[:, :prefix].transpose(1, 2), v_new], dim=2).float()
        g = heads // kv_heads
        k = k.repeat_interleave(g, dim=1)
        v = v.repeat_interleave(g, dim=1)
        w = (q.float() @ k.transpose(-1, -2)) * scale
        # New token i sees the prefix and new tokens <= i (bottom-right causal).
        mask = torch.ones(q_len, total, dtype=torch.bool, device=dev).tril(diagonal=prefix)
        w = w.masked_fill(~mask, float("-inf")).softmax(-1)
        ref = (w @ v).transpose(1, 2)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        if not (err < 2e-2):
            fail(2, f"the timed attention differs from the reference at prefix {prefix}, "
                    f"{q_len} new tokens: relative error {err:.3g}")
    KvState.k = KvState.v = None


def build_model(torch, transformers, cfg, built):
    from transformers import AutoModel
    cfg.num_hidden_layers = built
    cfg.vocab_size = 256  # embeddings are never used; keep them small
    # ...and a padding id from the real vocabulary would point past them.
    if getattr(cfg, "pad_token_id", None) is not None and cfg.pad_token_id >= cfg.vocab_size:
        cfg.pad_token_id = None
    cfg.use_cache = False
    torch.manual_seed(0)
    # Built with SDPA (every version accepts it), then switched to the
    # registered "kvtier" attention: the layers look it up in their config
    # at every forward. transformers 5 names the dtype argument `dtype`.
    with torch.device("cuda"):
        try:
            model = AutoModel.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        except TypeError:
            model = AutoModel.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config._attn_implementation = "kvtier"
    model.eval()
    return model


def main():
    args = parse_args()
    torch, transformers, flash = import_stack(args.attention)
    attention = make_attention(torch, flash)
    try:
        from transformers import AttentionInterface  # 4.50+
        AttentionInterface.register("kvtier", attention)
    except ImportError:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS["kvtier"] = attention

    if args.check and args.config is None:
        cfg = transformers.AutoConfig.for_model("llama", **{k: v for k, v in TINY_CONFIG.items()
                                                            if k != "model_type"})
        raw = dict(TINY_CONFIG)
    else:
        cfg, raw = load_config(transformers, args.config)
    total_layers = int(raw["num_hidden_layers"])
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads

    if args.check:
        with torch.inference_mode():
            check_attention(torch, attention, kv_heads, heads, head_dim)
        inputs, prefixes, contexts = [16], [32], [64]
        built = 1
    else:
        inputs = int_list(args.inputs)
        prefixes = int_list(args.prefixes)
        contexts = int_list(args.contexts)
        if min(inputs) < 1 or min(contexts) < 1:
            fail(2, "input lengths and decode contexts must be >= 1")
        free, _ = torch.cuda.mem_get_info()
        built = args.layers or max(1, min(8, int(free * 0.5 // layer_bytes(cfg))))
    built = min(built, total_layers)
    print(f"torch_harness: building {built} of {total_layers} layers of {raw.get('model_type')} "
          f"({layer_bytes(cfg) / 2**30:.2f} GiB each) on {torch.cuda.get_device_name()}, "
          f"{args.timing} timing", file=sys.stderr)
    model = build_model(torch, transformers, cfg, built)
    layers = getattr(model, "layers", None)
    rotary = getattr(model, "rotary_emb", None)
    if layers is None or rotary is None:
        fail(2, f"model_type {raw.get('model_type')!r}: the base model has no .layers/.rotary_emb; "
                "the harness supports Llama-style decoders (llama, qwen2, qwen3, glm, mistral, ...)")

    def run_layer(layer, hidden, pos_ids, pos_emb):
        out = layer(hidden_states=hidden, attention_mask=None, position_ids=pos_ids,
                    position_embeddings=pos_emb, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    spreads = []

    def time_point(n_new, n_prefix):
        total = n_prefix + n_new
        KvState.k = torch.empty((1, total, kv_heads, head_dim), dtype=torch.bfloat16, device="cuda")
        KvState.v = torch.empty_like(KvState.k)
        if n_prefix:
            KvState.k[:, :n_prefix].normal_()
            KvState.v[:, :n_prefix].normal_()
        KvState.prefix = n_prefix
        hidden = torch.randn((1, n_new, cfg.hidden_size), dtype=torch.bfloat16, device="cuda")
        pos_ids = torch.arange(n_prefix, total, device="cuda").unsqueeze(0)
        pos_emb = rotary(hidden, pos_ids)

        def one_pass():
            for l in range(built):
                run_layer(layers[l], hidden, pos_ids, pos_emb)

        # The attention must run once per layer, over prefix + new keys.
        KvState.calls, KvState.keys_seen = 0, -1
        one_pass()
        torch.cuda.synchronize()
        if KvState.calls != built or KvState.keys_seen != total:
            fail(2, f"the timed attention ran {KvState.calls} times over {KvState.keys_seen} keys "
                    f"for {built} layers and {total} keys: the layers do not call it")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph = None
        if args.timing == "graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(max(1, args.warmup)):
                    one_pass()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    one_pass()
            except RuntimeError as e:
                # Said, not hidden: the trace's provenance says eager from here on.
                print(f"torch_harness: CUDA graph capture failed ({e}); timing eagerly from here on",
                      file=sys.stderr)
                args.timing = "eager"
                graph = None
                torch.cuda.synchronize()
        if graph is not None:
            for _ in range(max(1, args.warmup)):
                graph.replay()
            runs = []
            for _ in range(max(1, args.repeats)):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) * 1000.0 / built)
            del graph
            per_layer = statistics.median(runs)
            spreads.append((max(runs) - min(runs)) / per_layer if per_layer > 0 else 0.0)
            times = [round(per_layer, 3)] * total_layers
        else:
            for _ in range(max(0, args.warmup)):
                run_layer(layers[0], hidden, pos_ids, pos_emb)
            runs = []
            for _ in range(max(1, args.repeats)):
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(total_layers)]
                for l in range(total_layers):
                    s, e = events[l]
                    s.record()
                    run_layer(layers[l % built], hidden, pos_ids, pos_emb)
                    e.record()
                torch.cuda.synchronize()
                runs.append([s.elapsed_time(e) * 1000.0 for s, e in events])
            times = [round(statistics.median(r[l] for r in runs), 3) for l in range(total_layers)]
        KvState.k = KvState.v = None
        del hidden, pos_emb
        return times

    prefill = []
    decode = []
    points = [(i, p) for i in inputs for p in prefixes]
    t0 = time.time()
    with torch.inference_mode():
        for k, (i, p) in enumerate(points):
            try:
                times = time_point(i, p)
            except torch.cuda.OutOfMemoryError as e:
                fail(2, f"out of GPU memory at input {i}, prefix {p} ({e}); "
                        "use smaller --inputs/--prefixes or --torch-arg=--layers=1")
            prefill.append({"input": i, "prefix": p, "layer_us": times})
            print(f"torch_harness: prefill {k + 1}/{len(points)} input {i} prefix {p}: "
                  f"{sum(times) / 1e3:.2f} ms ({time.time() - t0:.0f} s)", file=sys.stderr)
            torch.cuda.empty_cache()
        for k, c in enumerate(contexts):
            times = time_point(1, c - 1)
            decode.append({"context": c, "layer_us": times})
            print(f"torch_harness: decode {k + 1}/{len(contexts)} context {c}: "
                  f"{sum(times) / 1e3:.3f} ms", file=sys.stderr)
            torch.cuda.empty_cache()

    if args.check:
        print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{torch.cuda.get_device_name()}, attention {'flash_attn' if flash else 'sdpa'} "
              f"(matches a float32 reference), {args.timing} timing: a tiny prefill "
              f"{sum(prefill[0]['layer_us']):.0f} us, decode {sum(decode[0]['layer_us']):.0f} us")
        return
    spread = f", max spread {100 * max(spreads):.1f}% of the median" if spreads else ""
    trace = {
        "schema": "kvtier-trace/1",
        "model": args.name or raw.get("_name_or_path") or raw.get("model_type"),
        "layers": total_layers,
        "device": torch.cuda.get_device_name(),
        "software": (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"attention {'flash_attn' if flash else 'sdpa'}, {built} distinct layers, "
                     f"{args.timing} timing, median of {max(1, args.repeats)} after "
                     f"{max(0, args.warmup)} warmup{spread}"),
        "prefill": prefill,
        "decode": decode,
    }
    if not all(math.isfinite(t) for row in prefill + decode for t in row["layer_us"]):
        fail(2, "a layer time is not finite; CUDA events misbehaved")
    text = json.dumps(trace)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
