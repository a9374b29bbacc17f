#!/usr/bin/env python3
"""kvtier-profile's torch harness: time a model's decoder layers on a GPU.

`kvtier-profile --compute torch` runs this; it can also be run by hand and its
output fed to `kvtier-profile --compute trace FILE`.

What it does:
  * builds the model's decoder layers from a Hugging Face config.json with
    random bf16 weights (transformers' own layer classes: Llama, Qwen3, GLM, ...);
  * for every (input, prefix) grid point, runs a prefill of `input` new tokens
    over `prefix` cached tokens through every layer and times each layer with
    CUDA events (median over --repeats after --warmup passes);
  * for every decode context C, one decode step (1 new token over C-1 cached),
    every layer timed the same way;
  * writes the kvtier-trace/1 JSON (see profiler/src/trace.rs) to --out or stdout.

The KV cache is a preallocated buffer, as in a serving engine's paged cache:
the layer's new K/V are copied into it (vLLM's reshape_and_cache) and
attention runs over the prefix plus the new tokens, causally aligned to the
bottom right (new token i sees the whole prefix and new tokens <= i):
  * flash_attn.flash_attn_func when flash-attn is installed (what vLLM's
    FlashAttention backend runs; GQA native);
  * else torch SDPA with torch.nn.attention.bias.causal_lower_right (KV heads
    repeated for GQA in prefill; enable_gqa for decode when torch has it).
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
    ap.add_argument("--config", required=True, help="Hugging Face config.json of the model")
    ap.add_argument("--name", default=None, help="model name written into the trace")
    ap.add_argument("--inputs", required=True, help="input lengths, e.g. 512,1024")
    ap.add_argument("--prefixes", required=True, help="prefix lengths, e.g. 0,2048")
    ap.add_argument("--contexts", required=True, help="decode context lengths, e.g. 1024,4096")
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct layers to build (0: as many as fit in half the free memory, at most 8)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed passes per grid point")
    ap.add_argument("--repeats", type=int, default=1, help="timed passes per grid point (median taken)")
    ap.add_argument("--attention", choices=["auto", "flash", "sdpa"], default="auto")
    ap.add_argument("--out", default=None, help="write the trace here (default: stdout)")
    ap.add_argument("--check", action="store_true",
                    help="only check that torch, transformers and CUDA are usable")
    return ap.parse_args()


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
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            if p == 0:
                out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
            elif lower_right is not None:
                mask = lower_right(q_len, total)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
            elif q_len * total <= (1 << 28):
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


def main():
    args = parse_args()
    torch, transformers, flash = import_stack(args.attention)
    if args.check:
        print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, "
              f"{torch.cuda.get_device_name()}, attention {'flash_attn' if flash else 'sdpa'}")
        return
    inputs = int_list(args.inputs)
    prefixes = int_list(args.prefixes)
    contexts = int_list(args.contexts)
    if min(inputs) < 1 or min(contexts) < 1:
        fail(2, "input lengths and decode contexts must be >= 1")

    from transformers import AutoModel
    attention = make_attention(torch, flash)
    try:
        from transformers import AttentionInterface  # 4.50+
        AttentionInterface.register("kvtier", attention)
    except ImportError:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS["kvtier"] = attention

    cfg, raw = load_config(transformers, args.config)
    total_layers = int(raw["num_hidden_layers"])
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads

    free, _ = torch.cuda.mem_get_info()
    per_layer = layer_bytes(cfg)
    built = args.layers or max(1, min(8, int(free * 0.5 // per_layer)))
    built = min(built, total_layers)
    cfg.num_hidden_layers = built
    cfg.vocab_size = 256  # embeddings are never used; keep them small
    cfg.use_cache = False
    torch.manual_seed(0)
    print(f"torch_harness: building {built} of {total_layers} layers of {raw.get('model_type')} "
          f"({per_layer / 2**30:.2f} GiB each) on {torch.cuda.get_device_name()}", file=sys.stderr)
    # Built with SDPA (every version accepts it), then switched to the
    # registered "kvtier" attention: the layers look it up in their config
    # at every forward.
    with torch.device("cuda"):
        model = AutoModel.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    model.config._attn_implementation = "kvtier"
    model.eval()
    layers = getattr(model, "layers", None)
    rotary = getattr(model, "rotary_emb", None)
    if layers is None or rotary is None:
        fail(2, f"model_type {raw.get('model_type')!r}: the base model has no .layers/.rotary_emb; "
                "the harness supports Llama-style decoders (llama, qwen2, qwen3, glm, mistral, ...)")

    def run_layer(layer, hidden, pos_ids, pos_emb):
        out = layer(hidden_states=hidden, attention_mask=None, position_ids=pos_ids,
                    position_embeddings=pos_emb, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

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
        for _ in range(max(0, args.warmup)):
            run_layer(layers[0], hidden, pos_ids, pos_emb)
        runs = []
        for _ in range(max(1, args.repeats)):
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(total_layers)]
            for l in range(total_layers):
                start, end = events[l]
                start.record()
                run_layer(layers[l % built], hidden, pos_ids, pos_emb)
                end.record()
            torch.cuda.synchronize()
            runs.append([s.elapsed_time(e) * 1000.0 for s, e in events])
        KvState.k = KvState.v = None
        del hidden, pos_emb
        return [round(statistics.median(r[l] for r in runs), 3) for l in range(total_layers)]

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

    trace = {
        "schema": "kvtier-trace/1",
        "model": args.name or raw.get("_name_or_path") or raw.get("model_type"),
        "layers": total_layers,
        "device": torch.cuda.get_device_name(),
        "software": (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"attention {'flash_attn' if flash else 'sdpa'}, {built} distinct layers, "
                     f"median of {max(1, args.repeats)} after {max(0, args.warmup)} warmup"),
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
