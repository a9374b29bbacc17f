#!/usr/bin/env python3
"""kvtier-profile's torch harness: time a model's decoder layers on a GPU.

`kvtier-profile --compute torch` runs this; it can also be run by hand and its
output fed to `kvtier-profile --compute trace FILE`.

What it does:
  * builds the model's decoder layers from a Hugging Face config.json with
    random bf16 weights (transformers' own layer classes: Llama, Qwen3, GLM, ...);
  * for every (input, prefix) grid point, a prefill of `input` new tokens over
    `prefix` cached tokens through the built layers; for every decode context
    C, one decode step (1 new token over C-1 cached);
  * times them (--timing):
      - graph (the default on CUDA): the pass over the built layers is
        captured once as a CUDA graph and the replay is timed between CUDA
        events, so the time is GPU time. A layer's time is the replay's time
        over the layers in it. Per-layer eager timing measured Python's
        kernel-launch rate instead: on an H100 it made a llama3-8b decode step
        read 39 ms where the GPU takes a few ms;
      - eager: CUDA events around every layer run eagerly (the old way: an
        upper bound, launch-bound for decode and short prefills; for a torch
        that cannot capture); a failed capture falls back to it, and says so;
      - cpu (--device cpu): wall time of the pass; for testing the harness
        itself on a machine without a GPU, not for tables;
    the median over --repeats (default 5) after --warmup (default 2), with the
    spread (min, p10, p90, max) kept in the trace;
  * checks that what it times is the model's attention over prefix + input:
    the attention is compared once with a float32 reference (prefill over a
    prefix, prefill alone, decode; grouped-query heads as the model has them),
    a layer against transformers' own SDPA attention, and at every grid point
    the attention must run once per layer over exactly prefix + input keys,
    and the graph's output must equal the eager pass's;
  * keeps within a time budget (--budget-s, default 420 s from its start):
    it estimates every point's cost from a short measurement of the device's
    matmul and memory rates, drops the largest inputs / prefixes / contexts
    that cannot fit (saying so up front), runs the points cheapest first, and
    if its estimates were short stops before a point would overrun, writing a
    valid trace marked "partial" that names the missing points;
  * writes the kvtier-trace/1 JSON (see profiler/src/trace.rs) to --out or stdout.

`--check` alone checks torch, transformers and the device, builds one layer
(of --config, or of a tiny built-in Llama), runs the attention and layer
checks and a tiny prefill and decode through the timed path, and prints ok
with the versions.

The KV cache is a preallocated buffer, as in a serving engine's paged cache:
the layer's new K/V are copied into it (vLLM's reshape_and_cache) and
attention runs over the prefix plus the new tokens, causally aligned to the
bottom right (new token i sees the whole prefix and new tokens <= i):
  * flash_attn.flash_attn_func when flash-attn is installed (what vLLM's
    FlashAttention backend runs; GQA native);
  * else torch SDPA, grouped-query heads through enable_gqa (torch >= 2.5;
    K/V heads repeated only where the kernel would refuse it, which the
    trace's software line says), prefill over a prefix with
    torch.nn.attention.bias.causal_lower_right (FlashAttention on CUDA).
--attention picks one explicitly.

Only `--layers` distinct layers are built (by default as many as fit in half
the free GPU memory, at most 8): layer l of the model takes built layer
l % layers' time. All decoder layers of these models have the same shape, so
this changes which weights are read, not how long a layer takes; it keeps
70B-class models on one GPU. Every layer input is the same random hidden
state (random weights would otherwise drive activations to inf after a few
layers; the kernels' time does not depend on the values).

Exit status: 0 done (a trace cut short by the budget is still 0, and marked
partial); 2 bad arguments or config, a failed check, or a budget nothing
fits in; 3 torch, transformers or CUDA is missing (kvtier-profile reports it
as such).
"""

import argparse
import json
import math
import statistics
import sys
import time

T_START = time.monotonic()


def fail(code, msg):
    print(f"torch_harness: {msg}", file=sys.stderr)
    sys.exit(code)


def say(msg):
    print(f"torch_harness: {msg}", file=sys.stderr, flush=True)


def int_list(s):
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        fail(2, f"{s!r} is not a comma-separated list of integers")
    if not out or any(v < 0 for v in out):
        fail(2, f"{s!r}: give at least one non-negative integer")
    return sorted(set(out))


# A two-layer Llama for --check without --config and for tests on a CPU:
# grouped-query heads (4 query heads over 2 KV heads), built in a moment anywhere.
TINY_CONFIG = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None,
                    help="Hugging Face config.json of the model (--check: a tiny built-in Llama if absent)")
    ap.add_argument("--name", default=None, help="model name written into the trace")
    ap.add_argument("--inputs", default=None, help="input lengths, e.g. 512,1024")
    ap.add_argument("--prefixes", default=None, help="prefix lengths, e.g. 0,2048")
    ap.add_argument("--contexts", default=None, help="decode context lengths, e.g. 1024,4096")
    ap.add_argument("--layers", type=int, default=0,
                    help="distinct layers to build (0: as many as fit in half the free memory, at most 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed passes per grid point (default 2)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed passes per grid point; the median is taken (default 5)")
    ap.add_argument("--timing", choices=["auto", "graph", "eager"], default="auto",
                    help="graph: replay a CUDA graph of the layers (GPU time; the default on CUDA); "
                         "eager: CUDA events around each eagerly run layer (launch-bound)")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="auto/cuda: the CUDA GPU (exit 3 without one); cpu: for testing the harness only")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds the whole run may take from the harness's start (0: no limit; default 420)")
    ap.add_argument("--assume-rates", default=None, metavar="TFLOPS,GBS",
                    help="estimate the budget from these matmul TFLOP/s and memory GB/s instead of measuring them")
    ap.add_argument("--attention", choices=["auto", "flash", "sdpa"], default="auto")
    ap.add_argument("--out", default=None, help="write the trace here (default: stdout)")
    ap.add_argument("--check", action="store_true",
                    help="check torch, transformers, the device and the timed attention against a reference, "
                         "run a tiny prefill and decode, print ok and exit (needs no grid)")
    args = ap.parse_args(argv)
    if not args.check and None in (args.config, args.inputs, args.prefixes, args.contexts):
        fail(2, "give --config, --inputs, --prefixes and --contexts (or --check alone)")
    if args.repeats < 1 or args.warmup < 0:
        fail(2, "--repeats must be >= 1 and --warmup >= 0")
    if not (args.budget_s >= 0 and math.isfinite(args.budget_s)):
        fail(2, "--budget-s must be a number of seconds >= 0 (0: no limit)")
    if args.device == "cpu" and args.timing == "graph":
        fail(2, "--timing graph needs CUDA; --device cpu times wall clock")
    if args.layers < 0:
        fail(2, "--layers must be >= 0")
    if args.assume_rates is not None:
        try:
            tf, gbs = (float(x) for x in args.assume_rates.split(","))
        except ValueError:
            tf = gbs = -1.0
        if not (tf > 0 and gbs > 0 and math.isfinite(tf) and math.isfinite(gbs)):
            fail(2, f"--assume-rates {args.assume_rates!r}: give TFLOPS,GBS, two positive numbers")
        args.assume_rates = (tf * 1e12, gbs * 1e9)
    return args


# ---------------------------------------------------------------------------
# Cost model and budget: plain Python, no torch (tested without it).

class Geometry:
    """What a layer's cost depends on."""

    def __init__(self, hidden, heads, kv_heads, head_dim, intermediate, layers_built):
        self.hidden = hidden
        self.heads = heads
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.intermediate = intermediate
        self.built = layers_built

    def weights(self):
        h, hd = self.hidden, self.head_dim
        return h * (self.heads * hd + 2 * self.kv_heads * hd) + self.heads * hd * h + 3 * h * self.intermediate

    def matmul_flops(self, n_new):
        """FLOPs of one layer's projections and MLP."""
        return 2 * self.weights() * n_new

    def attention_flops(self, n_new, n_prefix):
        """FLOPs of one layer's attention over the prefix plus the causal half
        of the new tokens."""
        keys = n_prefix + (n_new + 1) / 2
        return 4 * self.heads * self.head_dim * n_new * keys

    def flops(self, n_new, n_prefix):
        return self.matmul_flops(n_new) + self.attention_flops(n_new, n_prefix)

    def bytes(self, n_new, n_prefix):
        """HBM bytes of one layer (bf16): the weights, the KV read, and the
        activations (a dozen hidden-sized and three intermediate-sized
        tensors in and out)."""
        kv = 2 * (n_prefix + n_new) * self.kv_heads * self.head_dim
        act = n_new * (12 * self.hidden + 6 * self.intermediate)
        return 2 * (self.weights() + kv + act)


class Rates:
    """The device's measured rates, and per-pass costs from them.

    `launch_s` is the CPU time an eager layer takes to launch (the floor of an
    eager pass); `fixed_s` what a grid point costs besides its passes
    (buffers, capture, freeing); `scale` corrects the pass estimates once
    points have been measured."""

    def __init__(self, flops_per_s, bytes_per_s, launch_s, fixed_s):
        self.flops_per_s = flops_per_s
        self.bytes_per_s = bytes_per_s
        self.launch_s = launch_s
        self.fixed_s = fixed_s
        self.scale = 1.0

    # Attention kernels reach about half the dense matmul rate (FlashAttention
    # 2 on an H100: ~350 of ~700 TFLOP/s).
    ATTENTION_SHARE = 0.5

    def layer_s(self, geo, n_new, n_prefix):
        return (geo.matmul_flops(n_new) / self.flops_per_s
                + geo.attention_flops(n_new, n_prefix) / (self.ATTENTION_SHARE * self.flops_per_s)
                + geo.bytes(n_new, n_prefix) / self.bytes_per_s)


# A timed pass runs as many of the built layers as take about this long on
# the device (at least one): decode and short prefills stream every built
# layer's weights, as the model does, while a long prefill, compute-bound,
# is timed on fewer layers instead of spending the budget on repeating them.
PASS_TARGET_S = 0.02


def pass_layers(rates, geo, n_new, n_prefix):
    """How many built layers a timed pass of this point runs."""
    layer = rates.layer_s(geo, n_new, n_prefix)
    return max(1, min(geo.built, math.ceil(PASS_TARGET_S / max(layer, 1e-9))))


def passes(timing, warmup, repeats):
    """(passes the device runs in full, eager passes whose launch is the
    floor), in units of a point's pass."""
    if timing == "graph":
        # eager check, eager warmup before capture, capture (launched, not run,
        # counted as eager), warmup replays, timed replays, the check replay.
        return warmup + repeats + 1, 3
    return 0, 1 + warmup + repeats  # eager, cpu: the check, warmup, repeats


def point_cost(rates, geo, timing, warmup, repeats, n_new, n_prefix):
    """(fixed, variable) seconds a grid point is estimated to take."""
    layer = rates.layer_s(geo, n_new, n_prefix)
    k = pass_layers(rates, geo, n_new, n_prefix)
    device, eager = passes(timing, warmup, repeats)
    variable = k * (device * layer + eager * max(layer, rates.launch_s))
    return rates.fixed_s, variable * rates.scale


def plan_grid(inputs, prefixes, contexts, prefill_cost, decode_cost, budget_s):
    """The largest grid estimated to fit `budget_s` seconds: while the whole
    grid does not, drop the largest input (a row), the largest prefix (a
    column) or the largest decode context, whichever saves the most per point
    given up. At least one of each stays. Returns (inputs, prefixes, contexts,
    estimated seconds, whether it fits)."""
    I, P, C = sorted(set(inputs)), sorted(set(prefixes)), sorted(set(contexts))

    def total():
        return sum(prefill_cost(i, p) for i in I for p in P) + sum(decode_cost(c) for c in C)

    while budget_s > 0 and total() > budget_s:
        options = []
        if len(I) > 1:
            options.append((sum(prefill_cost(I[-1], p) for p in P) / len(P), 0))
        if len(P) > 1:
            options.append((sum(prefill_cost(i, P[-1]) for i in I) / len(I), 1))
        if len(C) > 1:
            options.append((decode_cost(C[-1]), 2))
        if not options:
            break
        _, which = max(options)
        (I, P, C)[which].pop()
    t = total()
    return I, P, C, t, budget_s <= 0 or t <= budget_s


def spread(values):
    """min, p10, median, p90, max (linear interpolation between order statistics)."""
    v = sorted(values)

    def q(f):
        x = f * (len(v) - 1)
        lo = int(math.floor(x))
        hi = min(lo + 1, len(v) - 1)
        return v[lo] + (v[hi] - v[lo]) * (x - lo)

    return {"min": round(v[0], 3), "p10": round(q(0.1), 3), "median": round(statistics.median(v), 3),
            "p90": round(q(0.9), 3), "max": round(v[-1], 3)}


# ---------------------------------------------------------------------------
# torch from here on.

def import_stack(args):
    try:
        import torch
    except ImportError as e:
        fail(3, f"torch is not installed ({e}); pip install torch (with CUDA)")
    if args.device in ("auto", "cuda") and not torch.cuda.is_available():
        fail(3, f"torch {torch.__version__} sees no CUDA GPU (torch.cuda.is_available() is False); "
                "--device cpu runs the harness on the CPU for testing only")
    device = "cpu" if args.device == "cpu" else "cuda"
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
    if args.attention in ("auto", "flash") and device == "cuda":
        try:
            from flash_attn import flash_attn_func
            flash = flash_attn_func
        except ImportError as e:
            if args.attention == "flash":
                fail(3, f"--attention flash: flash-attn is not installed ({e})")
    elif args.attention == "flash":
        fail(2, "--attention flash needs CUDA")
    return torch, transformers, flash, device


def version_tuple(v):
    out = []
    for part in v.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


class KvState:
    """The preallocated cache the custom attention writes into and reads from,
    and what the attention saw (so a pass that skipped it, or attended over
    other keys, fails instead of timing something else)."""
    k = None  # (1, T, kv_heads, head_dim)
    v = None
    prefix = 0
    calls = 0
    keys_seen = -1
    bad = None  # the first inconsistency the attention met, if any


class Attention:
    """The timed attention and the facts about it that go into the trace."""

    def __init__(self, torch, flash, device, heads, kv_heads, head_dim):
        import torch.nn.functional as F
        self.torch = torch
        self.F = F
        self.flash = flash
        self.lower_right = None
        try:
            from torch.nn.attention.bias import causal_lower_right
            self.lower_right = causal_lower_right
        except ImportError:
            pass
        self.groups = heads // kv_heads
        self.gqa_kw = version_tuple(torch.__version__) >= (2, 5)  # SDPA's enable_gqa
        # Prefill over a prefix goes through causal_lower_right, which runs
        # FlashAttention directly when it accepts the inputs (with enable_gqa,
        # FlashAttention takes fewer K/V heads as they are) and otherwise
        # another kernel that needs equal head counts. Ask once.
        self.lower_right_gqa = self.gqa_kw and self.groups > 1
        if self.lower_right_gqa and device == "cuda" and flash is None:
            try:
                from torch.backends.cuda import SDPAParams, can_use_flash_attention
                q = torch.empty((1, heads, 16, head_dim), dtype=torch.bfloat16, device=device)
                k = torch.empty((1, kv_heads, 48, head_dim), dtype=torch.bfloat16, device=device)
                params = SDPAParams(q, k, k, None, 0.0, False, True)
                self.lower_right_gqa = bool(can_use_flash_attention(params))
            except Exception:  # an SDPAParams of another signature: say repeated, to be safe
                self.lower_right_gqa = False
        if flash is not None:
            self.describe = "flash_attn (GQA native)"
        elif self.groups == 1:
            self.describe = "sdpa"
        elif not self.gqa_kw:
            self.describe = "sdpa (K/V heads repeated for GQA: torch < 2.5 has no enable_gqa)"
        elif self.lower_right_gqa:
            self.describe = "sdpa (GQA through enable_gqa)"
        else:
            self.describe = ("sdpa (GQA through enable_gqa; K/V heads repeated for prefill over a prefix, "
                             "where FlashAttention refuses enable_gqa)")

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        torch, F = self.torch, self.F
        # query: (1, H, q, d); key/value: (1, kvH, q, d), the new tokens only.
        p = KvState.prefix
        q_len = query.shape[2]
        total = p + q_len
        KvState.calls += 1
        KvState.keys_seen = total
        if KvState.k is None or KvState.k.shape[1] < total:
            KvState.bad = (f"the KV buffer holds {None if KvState.k is None else KvState.k.shape[1]} "
                           f"tokens, not prefix {p} + {q_len} new")
            raise RuntimeError(KvState.bad)
        KvState.k[:, p:total].copy_(key.transpose(1, 2))
        KvState.v[:, p:total].copy_(value.transpose(1, 2))
        k = KvState.k[:, :total]
        v = KvState.v[:, :total]
        if self.flash is not None:
            out = self.flash(query.transpose(1, 2), k, v, softmax_scale=scaling, causal=True)
        else:
            k = k.transpose(1, 2)
            v = v.transpose(1, 2)
            gqa = {}
            if self.groups > 1:
                native = self.gqa_kw and (q_len == 1 or p == 0 or self.lower_right_gqa)
                if native:
                    gqa = {"enable_gqa": True}
                else:
                    k = k.repeat_interleave(self.groups, dim=1)
                    v = v.repeat_interleave(self.groups, dim=1)
            if q_len == 1:  # one new token sees everything
                out = F.scaled_dot_product_attention(query, k, v, scale=scaling, **gqa)
            elif p == 0:
                out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling, **gqa)
            elif self.lower_right is not None:
                mask = self.lower_right(q_len, total)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, **gqa)
            elif q_len * total <= (1 << 28):
                mask = torch.ones(q_len, total, dtype=torch.bool, device=query.device).tril(diagonal=p)
                out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling, **gqa)
            else:
                fail(3, "this torch has no causal_lower_right and the mask would be too large; "
                        "install flash-attn or torch >= 2.3")
            out = out.transpose(1, 2)
        want = (query.shape[0], q_len, query.shape[1], query.shape[3])
        if tuple(out.shape) != want:
            KvState.bad = f"the attention's output is {tuple(out.shape)}, not {want}"
            raise RuntimeError(KvState.bad)
        return out.contiguous(), None


def rel_err(torch, out, ref):
    out, ref = out.float(), ref.float()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def check_attention(torch, attention, device, heads, kv_heads, head_dim):
    """The timed attention against a float32 reference: prefill over a
    prefix, prefill alone, and a decode step, with the model's heads."""
    gen = torch.Generator(device="cpu").manual_seed(1)

    def randn(*shape):
        return torch.randn(shape, generator=gen).to(device=device, dtype=torch.bfloat16)

    scale = head_dim ** -0.5
    worst = 0.0
    for prefix, q_len in ((64, 32), (0, 48), (95, 1)):
        total = prefix + q_len
        k_all = randn(1, total, kv_heads, head_dim)
        v_all = randn(1, total, kv_heads, head_dim)
        q = randn(1, heads, q_len, head_dim)
        k_new = k_all[:, prefix:].transpose(1, 2).contiguous()
        v_new = v_all[:, prefix:].transpose(1, 2).contiguous()
        # The attention must write the new keys into the cache itself.
        KvState.k = torch.zeros_like(k_all)
        KvState.v = torch.zeros_like(v_all)
        KvState.k[:, :prefix] = k_all[:, :prefix]
        KvState.v[:, :prefix] = v_all[:, :prefix]
        KvState.prefix, KvState.calls, KvState.keys_seen = prefix, 0, -1
        out, _ = attention(None, q, k_new, v_new, None, scaling=scale)
        if KvState.calls != 1 or KvState.keys_seen != total:
            fail(2, f"attention check: the attention saw {KvState.keys_seen} keys, not {total}")
        g = heads // kv_heads
        k = k_all.transpose(1, 2).float().repeat_interleave(g, dim=1)
        v = v_all.transpose(1, 2).float().repeat_interleave(g, dim=1)
        w = (q.float() @ k.transpose(-1, -2)) * scale
        # New token i sees the prefix and new tokens <= i (bottom-right causal).
        mask = torch.ones(q_len, total, dtype=torch.bool, device=device).tril(diagonal=prefix)
        w = w.masked_fill(~mask, float("-inf")).softmax(-1)
        ref = (w @ v).transpose(1, 2)
        err = rel_err(torch, out, ref)
        if not err < 2e-2:
            fail(2, f"attention check: the timed attention differs from a float32 reference at prefix "
                    f"{prefix}, {q_len} new tokens: relative error {err:.3g}")
        worst = max(worst, err)
    KvState.k = KvState.v = None
    return worst


def load_config(transformers, path):
    if path is None:
        raw = dict(TINY_CONFIG)
        where = "the built-in tiny Llama"
    else:
        where = path
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            fail(2, f"{path}: cannot read the config ({e})")
    if "num_hidden_layers" not in raw and isinstance(raw.get("text_config"), dict):
        top = raw
        raw = dict(raw["text_config"])
        raw.setdefault("torch_dtype", top.get("torch_dtype", top.get("dtype", "bfloat16")))
    model_type = raw.get("model_type")
    if model_type == "chatglm":
        fail(2, f"{where}: model_type chatglm is remote code, not in transformers; use the HF-format "
                "config (model_type glm, e.g. THUDM/glm-4-9b-hf) or kvtier-profile's glm4-9b preset")
    if not model_type:
        fail(2, f"{where}: no model_type; the harness builds layers through transformers' AutoConfig")
    if "num_hidden_layers" not in raw:
        fail(2, f"{where}: no num_hidden_layers")
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "auto_map")}
    # transformers >= 4.56 calls it `dtype` and warns about `torch_dtype`.
    if new_dtype_api(transformers) and "torch_dtype" in kwargs:
        kwargs.setdefault("dtype", kwargs["torch_dtype"])
        del kwargs["torch_dtype"]
    try:
        cfg = transformers.AutoConfig.for_model(model_type, **kwargs)
    except (ValueError, KeyError) as e:
        fail(2, f"{where}: transformers {transformers.__version__} cannot build model_type {model_type!r}: {e}")
    return cfg, raw


def new_dtype_api(transformers):
    return version_tuple(transformers.__version__) >= (4, 56)


def build_model(torch, transformers, cfg, built, device):
    from transformers import AutoModel
    cfg.num_hidden_layers = built
    cfg.vocab_size = 256  # embeddings are never used; keep them small
    # ...and a padding id from the real vocabulary would point past them
    # (glm4's config: "Padding_idx must be within num_embeddings").
    if getattr(cfg, "pad_token_id", None) is not None and cfg.pad_token_id >= cfg.vocab_size:
        cfg.pad_token_id = None
    cfg.use_cache = False
    torch.manual_seed(0)
    # Built with SDPA (every version accepts it), then switched to the
    # registered "kvtier" attention: the layers look it up in their config at
    # every forward (which the checks confirm).
    dtype_kw = {"dtype": torch.bfloat16} if new_dtype_api(transformers) else {"torch_dtype": torch.bfloat16}
    with torch.device(device):
        model = AutoModel.from_config(cfg, attn_implementation="sdpa", **dtype_kw)
    model.config._attn_implementation = "kvtier"
    model.eval()
    return model


def measure_rates(torch, device, assumed=None):
    """Matmul FLOP/s and copy bytes/s of the device (or the `assumed` pair),
    the launch floor of an eager layer and a point's fixed cost: what the cost
    estimates start from."""
    # Eager transformers layers launch at about 1 ms each on a GPU (H100 box,
    # torch 2.11, transformers 5.17: 39 ms for 32 decode layers).
    launch_s, fixed_s = (1.5e-3, 0.15) if device == "cuda" else (1e-3, 0.01)
    if assumed is not None:
        return Rates(assumed[0], assumed[1], launch_s, fixed_s)
    dt = torch.bfloat16
    if device == "cuda":
        n, reps = 8192, 5
        a = torch.randn((n, n), dtype=dt, device=device)
        b = torch.randn((n, n), dtype=dt, device=device)
        x = torch.empty((1 << 29,), dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        a @ b
        y.copy_(x)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            a @ b
        e.record()
        e.synchronize()
        flops = 2 * n ** 3 * reps / (s.elapsed_time(e) / 1e3)
        s.record()
        for _ in range(reps):
            y.copy_(x)
        e.record()
        e.synchronize()
        bw = 2 * x.numel() * reps / (s.elapsed_time(e) / 1e3)
        del a, b, x, y
        torch.cuda.empty_cache()
        return Rates(flops, bw, launch_s, fixed_s)
    n, reps = 256, 4
    a = torch.randn((n, n), dtype=dt)
    b = torch.randn((n, n), dtype=dt)
    x = torch.empty((1 << 24,), dtype=torch.uint8)
    y = torch.empty_like(x)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    flops = 2 * n ** 3 * reps / max(time.perf_counter() - t, 1e-9)
    y.copy_(x)
    t = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    bw = 2 * x.numel() * reps / max(time.perf_counter() - t, 1e-9)
    return Rates(flops, bw, launch_s, fixed_s)


def main(argv=None):
    args = parse_args(argv)
    torch, transformers, flash, device = import_stack(args)
    timing = args.timing
    if timing == "auto":
        timing = "graph" if device == "cuda" else "cpu"
    if device == "cpu":
        timing = "cpu"
        torch.set_num_threads(1)  # no spinning OpenMP threads on a shared machine
    device_name = (torch.cuda.get_device_name() if device == "cuda"
                   else f"cpu ({torch.get_num_threads()} threads; harness test, not a GPU measurement)")

    cfg, raw = load_config(transformers, args.config)
    total_layers = int(raw["num_hidden_layers"])
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        fail(2, f"{heads} query heads are not a multiple of {kv_heads} KV heads")

    attention = Attention(torch, flash, device, heads, kv_heads, head_dim)
    try:
        from transformers import AttentionInterface  # 4.50+
        AttentionInterface.register("kvtier", attention)
    except ImportError:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        ALL_ATTENTION_FUNCTIONS["kvtier"] = attention

    if args.check:
        inputs, prefixes, contexts = [16], [32], [64]
        built = 1
    else:
        inputs, prefixes, contexts = int_list(args.inputs), int_list(args.prefixes), int_list(args.contexts)
        if min(inputs) < 1 or min(contexts) < 1:
            fail(2, "input lengths and decode contexts must be >= 1")
        geo0 = Geometry(cfg.hidden_size, heads, kv_heads, head_dim, cfg.intermediate_size, 1)
        if device == "cuda":
            free, _ = torch.cuda.mem_get_info()
            built = args.layers or max(1, min(8, int(free * 0.5 // (2 * geo0.weights()))))
        else:
            built = args.layers or min(2, total_layers)
    built = min(built, total_layers)
    geo = Geometry(cfg.hidden_size, heads, kv_heads, head_dim, cfg.intermediate_size, built)

    with torch.inference_mode():
        attn_err = check_attention(torch, attention, device, heads, kv_heads, head_dim)
    say(f"building {built} of {total_layers} layers of {raw.get('model_type')} "
        f"({2 * geo.weights() / 2**30:.3f} GiB each) on {device_name}; attention {attention.describe} "
        f"(matches a float32 reference: relative error {attn_err:.2g}); {timing} timing")
    model = build_model(torch, transformers, cfg, built, device)
    layers = getattr(model, "layers", None)
    rotary = getattr(model, "rotary_emb", None)
    if layers is None or rotary is None:
        fail(2, f"model_type {raw.get('model_type')!r}: the base model has no .layers/.rotary_emb; "
                "the harness supports Llama-style decoders (llama, qwen2, qwen3, glm, mistral, ...)")

    def run_layer(layer, hidden, pos_ids, pos_emb):
        out = layer(hidden_states=hidden, attention_mask=None, position_ids=pos_ids,
                    position_embeddings=pos_emb, use_cache=False)
        return out[0] if isinstance(out, tuple) else out

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def check_layer():
        """Layer 0 with the timed attention against the same layer with
        transformers' own SDPA attention (prefill, no prefix)."""
        n = 24
        gen = torch.Generator(device="cpu").manual_seed(2)
        hidden = torch.randn((1, n, cfg.hidden_size), generator=gen).to(device=device, dtype=torch.bfloat16)
        pos_ids = torch.arange(n, device=device).unsqueeze(0)
        pos_emb = rotary(hidden, pos_ids)
        KvState.k = torch.zeros((1, n, kv_heads, head_dim), dtype=torch.bfloat16, device=device)
        KvState.v = torch.zeros_like(KvState.k)
        KvState.prefix, KvState.calls, KvState.keys_seen = 0, 0, -1
        ours = run_layer(layers[0], hidden, pos_ids, pos_emb)
        calls = KvState.calls
        KvState.k = KvState.v = None
        if calls != 1:
            fail(2, f"layer check: a layer called the timed attention {calls} times, not once; "
                    f"transformers {transformers.__version__} does not route attention through "
                    "attn_implementation here")
        model.config._attn_implementation = "sdpa"
        try:
            ref = run_layer(layers[0], hidden, pos_ids, pos_emb)
        except Exception as e:  # the reference itself, not what is timed
            say(f"layer check skipped: transformers' own sdpa attention failed ({type(e).__name__}: {e})")
            return None
        finally:
            model.config._attn_implementation = "kvtier"
        err = rel_err(torch, ours, ref)
        if not err < 2e-2:
            fail(2, f"layer check: a layer with the timed attention differs from the same layer with "
                    f"transformers' sdpa attention: relative error {err:.3g}")
        return err

    with torch.inference_mode():
        layer_err = check_layer()

    state = {"timing": timing}

    def time_point(n_new, n_prefix, k):
        """Per-layer µs (one per model layer) and the spread over the repeats
        of the mean layer time, a pass running the first `k` built layers."""
        total = n_prefix + n_new
        KvState.k = torch.empty((1, total, kv_heads, head_dim), dtype=torch.bfloat16, device=device)
        KvState.v = torch.empty_like(KvState.k)
        if n_prefix:
            KvState.k[:, :n_prefix].normal_()
            KvState.v[:, :n_prefix].normal_()
        KvState.prefix = n_prefix
        hidden = torch.randn((1, n_new, cfg.hidden_size), dtype=torch.bfloat16, device=device)
        pos_ids = torch.arange(n_prefix, total, device=device).unsqueeze(0)
        pos_emb = rotary(hidden, pos_ids)

        def one_pass():
            out = None
            for layer in layers[:k]:
                out = run_layer(layer, hidden, pos_ids, pos_emb)
            return out

        def expect_attention(what):
            if KvState.calls != k or KvState.keys_seen != total or KvState.bad:
                fail(2, f"{what} at input {n_new}, prefix {n_prefix}: the timed attention ran "
                        f"{KvState.calls} times over {KvState.keys_seen} keys for {k} layers and "
                        f"{total} keys{': ' + KvState.bad if KvState.bad else ''}")

        # The attention must run once per layer, over prefix + new keys; its
        # output is what the graph must reproduce.
        KvState.calls, KvState.keys_seen, KvState.bad = 0, -1, None
        ref = one_pass()
        sync()
        expect_attention("eager pass")
        if tuple(ref.shape) != (1, n_new, cfg.hidden_size):
            fail(2, f"a layer's output is {tuple(ref.shape)}, not {(1, n_new, cfg.hidden_size)}")
        graph = None
        if state["timing"] == "graph":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                one_pass()
            torch.cuda.current_stream().wait_stream(side)
            sync()
            graph = torch.cuda.CUDAGraph()
            KvState.calls, KvState.keys_seen = 0, -1
            try:
                with torch.cuda.graph(graph):
                    static_out = one_pass()
            except torch.cuda.OutOfMemoryError:
                raise
            except RuntimeError as e:
                # Said, not hidden: the trace says eager from here on.
                say(f"CUDA graph capture failed ({e}); timing eagerly from here on (launch-bound)")
                state["timing"] = "eager"
                graph = None
                sync()
            if graph is not None:
                expect_attention("graph capture")
                graph.replay()
                sync()
                err = rel_err(torch, static_out, ref)
                if not err < 2e-2:
                    fail(2, f"the CUDA graph's output differs from the eager pass's at input {n_new}, "
                            f"prefix {n_prefix} (relative error {err:.3g}): the graph does not run the layers")
        runs = []
        if graph is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(args.warmup):
                graph.replay()
            for _ in range(args.repeats):
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                runs.append(start.elapsed_time(end) * 1000.0 / k)
            per_layer = [statistics.median(runs)] * total_layers
            del graph, static_out
        elif state["timing"] == "eager":
            for _ in range(args.warmup):
                run_layer(layers[0], hidden, pos_ids, pos_emb)
            per_run = []
            for _ in range(args.repeats):
                events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                          for _ in range(k)]
                for li in range(k):
                    s, e = events[li]
                    s.record()
                    run_layer(layers[li], hidden, pos_ids, pos_emb)
                    e.record()
                sync()
                per_run.append([s.elapsed_time(e) * 1000.0 for s, e in events])
            per_built = [statistics.median(r[li] for r in per_run) for li in range(k)]
            per_layer = [per_built[li % k] for li in range(total_layers)]
            runs = [sum(r) / k for r in per_run]
        else:  # cpu wall clock
            for _ in range(args.warmup):
                one_pass()
            for _ in range(args.repeats):
                t = time.perf_counter()
                one_pass()
                runs.append((time.perf_counter() - t) * 1e6 / k)
            per_layer = [statistics.median(runs)] * total_layers
        KvState.k = KvState.v = None
        del hidden, pos_emb, ref
        return [round(t, 3) for t in per_layer], spread(runs)

    # The grid: what is estimated to fit the budget, cheapest point first.
    rates = measure_rates(torch, device, args.assume_rates)

    def cost(n_new, n_prefix):
        fixed, var = point_cost(rates, geo, state["timing"], args.warmup, args.repeats, n_new, n_prefix)
        return fixed + var

    budget = args.budget_s if not args.check else 0.0
    left = budget - (time.monotonic() - T_START) if budget > 0 else 0.0
    if budget > 0 and left <= 0:
        fail(2, f"--budget-s {budget:g}: spent {time.monotonic() - T_START:.0f} s before the first point")
    I, P, C, est, fits = plan_grid(inputs, prefixes, contexts, cost, lambda c: cost(1, c - 1), left)
    dropped = ([f"input {i}" for i in inputs if i not in I] + [f"prefix {p}" for p in prefixes if p not in P]
               + [f"context {c}" for c in contexts if c not in C])
    if not fits:
        fail(2, f"--budget-s {budget:g}: even input {I[0]}, prefix {P[0]} and context {C[0]} alone are "
                f"estimated at {est:.0f} s, over the {left:.0f} s left; give smaller points or a larger budget")
    say(f"device rates{' (assumed)' if args.assume_rates else ''}: {rates.flops_per_s / 1e12:.3g} TFLOP/s "
        f"matmul, {rates.bytes_per_s / 1e9:.3g} GB/s copy; {len(I) * len(P)} prefill + {len(C)} decode points "
        f"estimated at {est:.1f} s"
        + (f" of the {left:.0f} s left of --budget-s {budget:g}" if budget > 0 else ""))
    if dropped:
        say(f"budget: the full grid is estimated over --budget-s {budget:g}; left out up front: "
            + ", ".join(dropped))

    jobs = [("prefill", i, p) for i in I for p in P] + [("decode", 1, c - 1) for c in C]
    jobs.sort(key=lambda j: cost(j[1], j[2]))
    prefill, decode, missing_prefill, missing_decode, notes = [], [], [], [], []
    if dropped:
        notes.append(f"left out up front to fit --budget-s {budget:g}: " + ", ".join(dropped))
    stopped = None
    with torch.inference_mode():
        for k, (kind, n_new, n_prefix) in enumerate(jobs):
            name = (f"prefill input {n_new} prefix {n_prefix}" if kind == "prefill"
                    else f"decode context {n_prefix + 1}")
            fixed, var = point_cost(rates, geo, state["timing"], args.warmup, args.repeats, n_new, n_prefix)
            k_layers = pass_layers(rates, geo, n_new, n_prefix)
            spent = time.monotonic() - T_START
            if stopped is None and budget > 0 and spent + fixed + var > budget:
                stopped = (f"stopped by --budget-s {budget:g} after {spent:.0f} s: {name} was estimated "
                           f"at {fixed + var:.0f} s more")
                say(stopped)
            if stopped is not None:
                if kind == "prefill":
                    missing_prefill.append([n_new, n_prefix])
                else:
                    missing_decode.append(n_prefix + 1)
                continue
            t0 = time.monotonic()
            try:
                times, stats = time_point(n_new, n_prefix, k_layers)
            except Exception as e:
                if device != "cuda" or not isinstance(e, torch.cuda.OutOfMemoryError):
                    raise
                KvState.k = KvState.v = None
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                say(f"{name}: out of GPU memory; left out (--torch-arg=--layers=1 or smaller points)")
                notes.append(f"{name}: out of GPU memory")
                if kind == "prefill":
                    missing_prefill.append([n_new, n_prefix])
                else:
                    missing_decode.append(n_prefix + 1)
                continue
            took = time.monotonic() - t0
            # Correct later estimates by how this one fared.
            if var >= rates.fixed_s:
                rates.scale = min(10.0, max(0.3, rates.scale * (took - rates.fixed_s) / var))
            else:
                rates.fixed_s = min(5.0, max(0.005, took - var))
            row = {"repeats": args.repeats, "pass_layers": k_layers, "spread_us": stats}
            if kind == "prefill":
                prefill.append({"input": n_new, "prefix": n_prefix, "layer_us": times, **row})
            else:
                decode.append({"context": n_prefix + 1, "layer_us": times, **row})
            say(f"{k + 1}/{len(jobs)} {name}: {sum(times) / 1e3:.3f} ms for {total_layers} layers "
                f"(layer p10-p90 {stats['p10']:.1f}-{stats['p90']:.1f} us; took {took:.2f} s, "
                f"estimated {fixed + var:.2f}; {time.monotonic() - T_START:.0f} s in)")
            if device == "cuda":
                torch.cuda.empty_cache()

    if not prefill or not decode:
        fail(2, f"{stopped or 'out of memory'}, before a prefill and a decode point were measured: no trace")
    if not all(math.isfinite(t) and t >= 0 for row in prefill + decode for t in row["layer_us"]):
        fail(2, "a layer time is not finite; the timer misbehaved")

    if args.check:
        print(f"ok: torch {torch.__version__}, transformers {transformers.__version__}, {device_name}, "
              f"attention {attention.describe} (matches a float32 reference: relative error {attn_err:.2g}; "
              f"a layer matches transformers' sdpa: "
              f"{'skipped' if layer_err is None else f'relative error {layer_err:.2g}'}), "
              f"{state['timing']} timing: one layer, prefill 16 over 32 "
              f"{prefill[0]['layer_us'][0]:.1f} us, decode at 64 {decode[0]['layer_us'][0]:.1f} us")
        return

    if stopped:
        notes.append(stopped)
    timing_line = {
        "graph": (f"CUDA-graph timing (a graph of up to {built} layers replayed between CUDA events, "
                  "over its layers)"),
        "eager": "eager timing (CUDA events around each layer; launch-bound, an upper bound)",
        "cpu": "cpu wall-clock timing (a harness test, not a GPU measurement)",
    }[state["timing"]]
    worst = max((r["spread_us"]["p90"] - r["spread_us"]["p10"]) / r["spread_us"]["median"]
                for r in prefill + decode if r["spread_us"]["median"] > 0) if prefill else 0.0
    partial = bool(missing_prefill or missing_decode or dropped)
    trace = {
        "schema": "kvtier-trace/1",
        "model": args.name or raw.get("_name_or_path") or raw.get("model_type"),
        "layers": total_layers,
        "device": device_name,
        "timing": state["timing"],
        "software": (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                     f"attention {attention.describe}, {built} distinct layers, {timing_line}, "
                     f"median of {args.repeats} after {args.warmup} warmup, "
                     f"widest p10-p90 {100 * worst:.1f}% of the median"),
        "partial": partial,
        "prefill": sorted(prefill, key=lambda r: (r["input"], r["prefix"])),
        "decode": sorted(decode, key=lambda r: r["context"]),
    }
    if partial:
        trace["missing_prefill"] = sorted(
            missing_prefill + [[i, p] for i in inputs for p in prefixes if i not in I or p not in P])
        trace["missing_decode"] = sorted(missing_decode + [c for c in contexts if c not in C])
    if notes:
        trace["note"] = "; ".join(notes)
    text = json.dumps(trace)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    say(f"done in {time.monotonic() - T_START:.0f} s" + (" (partial: " + trace["note"] + ")" if partial else ""))


if __name__ == "__main__":
    main()
