#!/usr/bin/env python3
"""Lookup latency from Python, idle and while loads run on the same handle.

The Python twin of `kvtier bench --lookups`: one thread times `lookup` of
16 stored keys, then `lookup_and_pin` + `unpin`, one pair about every 100 us;
a round is an idle phase, then a busy phase in which another Python thread
loads a whole stored context (all layers) again and again. Rounds alternate
in one run; the report gives p50/p99/p99.9/max per phase and, per round, the
busy p99 over the idle p99 (the goal: at most 2x).

    python scripts/py-lookup-latency.py --dir scratch/pylk [--tokens 16384] [--rounds 3]
"""

import argparse
import os
import statistics
import tempfile
import threading
import time

import kvtier


def pct(ns, p):
    s = sorted(ns)
    rank = min(len(s), max(1, int(-(-p * len(s) // 1))))
    return s[rank - 1] / 1e3


def summary(ns):
    return (pct(ns, 0.50), pct(ns, 0.99), pct(ns, 0.999), max(ns) / 1e3)


def time_lookups(tier, keys, per_call, samples):
    look, pin = [], []
    windows = len(keys) - per_call + 1
    hits = True
    for i in range(samples):
        start = (i * 7919) % windows
        w = keys[start:start + per_call]
        t = time.perf_counter_ns()
        n = tier.lookup(w)
        look.append(time.perf_counter_ns() - t)
        t = time.perf_counter_ns()
        m = tier.lookup_and_pin(w)
        tier.unpin(w[:m])
        pin.append(time.perf_counter_ns() - t)
        hits = hits and n == per_call and m == per_call
        time.sleep(50e-6)
    if not hits:
        raise SystemExit("a lookup of stored keys missed: the pool lost keys it held")
    return look, pin


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="pool directory (default: a temporary one)")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384, help="the context the busy phase loads")
    ap.add_argument("--samples", type=int, default=20000, help="lookups timed per phase")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lookup-keys", type=int, default=16)
    a = ap.parse_args()
    blocks = -(-a.tokens // a.block_size)
    if blocks < a.lookup_keys or a.samples < 1 or a.rounds < 1:
        raise SystemExit("give --tokens of at least --lookup-keys blocks, --samples >= 1, --rounds >= 1")
    d = a.dir or tempfile.mkdtemp(prefix="kvtier-pylk-")
    os.makedirs(d, exist_ok=True)
    geo, _ = kvtier.resolve_model(a.model, block_size=a.block_size)
    # The context and a few groups of slack: nothing is evicted.
    capacity = blocks * geo["block_bytes"] + (256 << 20)
    tier = (
        kvtier.TierBuilder()
        .directory(d)
        .capacity(capacity)
        .prewrite(False)
        .create("always")
        .model(a.model, block_size=a.block_size)
        .engine("uring")
        .host_cache(blocks, layout="per_layer")
        .build()
    )
    try:
        data = os.urandom(tier.block_bytes)
        for b in range(blocks):
            tier.write_block(b, data)
        keys = list(range(1, blocks + 1))
        mem = list(range(blocks))
        tier.wait(tier.submit_store(keys, mem)).raise_for_failure()
        gib = blocks * tier.block_bytes / (1 << 30)
        g = tier.geometry
        print(f"lookup latency from Python: {a.model} ({tier.engine} engine), {a.lookup_keys} keys per call, "
              f"{a.samples} calls per phase")
        print(f"busy: another Python thread loads a {a.tokens}-token context ({gib:.2f} GiB, "
              f"all {g['layers']} layers) again and again; {os.cpu_count()} CPUs")
        print(f"{'round':>5} {'phase':>5} {'lookup p50/p99/p99.9/max us':>30} "
              f"{'pin+unpin p50/p99/p99.9/max':>30} {'loads GiB/s':>13}")
        ratios = []
        for r in range(1, a.rounds + 1):
            idle = time_lookups(tier, keys, a.lookup_keys, a.samples)
            stop = threading.Event()
            done = []
            err = []

            def loader():
                try:
                    t0 = time.perf_counter()
                    n = 0
                    while not stop.is_set():
                        tier.wait(tier.submit_load(keys, mem)).raise_for_failure()
                        n += 1
                    done.append((n, time.perf_counter() - t0))
                except Exception as e:  # reported below, after the lookups
                    err.append(e)

            th = threading.Thread(target=loader)
            th.start()
            while tier.usage()["tier"]["jobs_in_flight"] == 0 and th.is_alive():
                time.sleep(0)
            busy = time_lookups(tier, keys, a.lookup_keys, a.samples)
            stop.set()
            th.join()
            if err:
                raise err[0]
            n, secs = done[0]
            fmt = lambda s: "{:.1f}/{:.1f}/{:.1f}/{:.0f}".format(*s)
            for name, (look, pin), loads in (("idle", idle, "-"),
                                             ("busy", busy, f"{n * gib / secs:.2f} ({n} loads)")):
                print(f"{r:>5} {name:>5} {fmt(summary(look)):>30} {fmt(summary(pin)):>30} {loads:>13}")
            rl = pct(busy[0], 0.99) / pct(idle[0], 0.99)
            rp = pct(busy[1], 0.99) / pct(idle[1], 0.99)
            ratios.append((rl, rp))
            print(f"{'':>5} p99 busy/idle: lookup {rl:.2f}x, pin+unpin {rp:.2f}x")
        print(f"\nmedian over {a.rounds} round(s) of p99 busy/idle: lookup "
              f"{statistics.median(x[0] for x in ratios):.2f}x, pin+unpin "
              f"{statistics.median(x[1] for x in ratios):.2f}x (goal: <= 2x)")
    finally:
        tier.close()
        if a.dir is None:
            for f in os.listdir(d):
                os.remove(os.path.join(d, f))
            os.rmdir(d)


if __name__ == "__main__":
    main()
