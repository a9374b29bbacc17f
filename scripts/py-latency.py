#!/usr/bin/env python3
"""Lookup / store / load latency through the kvtier Python bindings against
the Rust TierHandle underneath, in the same process, on the same pool and
memory, one after the other. Medians in microseconds.

    python scripts/py-latency.py [--dir DIR] [--model llama3-8b] [--iters 200]
"""

import argparse
import os
import statistics
import tempfile
import time

import kvtier
from kvtier import _kvtier


def median_ns(fn, iters):
    t = []
    for i in range(iters):
        s = time.perf_counter_ns()
        fn(i)
        t.append(time.perf_counter_ns() - s)
    return statistics.median(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="pool directory (default: a temporary one)")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--lookup-keys", type=int, default=16)
    a = ap.parse_args()
    d = a.dir or tempfile.mkdtemp(prefix="kvtier-pylat-")
    tier = (
        kvtier.TierBuilder()
        .directory(d)
        .capacity("2g")
        .create("always")
        .model(a.model, block_size=a.block_size)
        .policy("naive")
        .host_cache(4)
        .build()
    )
    try:
        tier.write_block(0, os.urandom(tier.block_bytes))
        keys = list(range(1, a.lookup_keys + 1))
        for k in keys:
            tier.wait(tier.submit_store([k], [0]))
        n = a.iters
        rows = []
        py_lookup = median_ns(lambda i: tier.lookup(keys), n)
        rs_lookup = _kvtier.rust_latency(tier, "lookup", keys, n, 0)
        rows.append((f"lookup {len(keys)} keys", py_lookup, rs_lookup))
        py_store = median_ns(lambda i: tier.wait(tier.submit_store([10**9 + i], [0])), n)
        rs_store = _kvtier.rust_latency(tier, "store", keys, n, 2 * 10**9)
        rows.append(("store 1 block, waited", py_store, rs_store))
        py_load = median_ns(lambda i: tier.wait(tier.submit_load(keys[:1], [1])), n)
        rs_load = _kvtier.rust_latency(tier, "load", keys, n, 0)
        rows.append(("load 1 block (all layers), waited", py_load, rs_load))
        try:
            # The vLLM connector's scheduler looks up through the worker's
            # socket (kvtier.vllm): that round trip against the handle's lookup.
            from kvtier import vllm as kvv

            name = b"\0kvtier-pylat-" + str(os.getpid()).encode()
            server = kvv._LookupServer(name, tier)
            client = kvv._LookupClient(name)
            bkeys = [k.to_bytes(32, "little") for k in keys]
            for k in bkeys:
                tier.wait(tier.submit_store([k], [0]))
            assert client.call(kvv._LOOKUP, bkeys) == len(bkeys)
            py_sock = median_ns(lambda i: client.call(kvv._LOOKUP, bkeys), n)
            rs_sock = _kvtier.rust_latency(tier, "lookup", bkeys, n, 0)
            rows.append((f"lookup {len(keys)} keys via connector socket", py_sock, rs_sock))
            server.close()
        except ImportError:
            pass
        g = tier.geometry
        print(f"model {a.model}: {g['layers']} layers, block {g['block_bytes'] // 1024} KiB; "
              f"engine {tier.engine}; {n} iterations each; medians")
        print(f"{'operation':38} {'python us':>10} {'rust us':>10} {'overhead us':>12}")
        for name, p, r in rows:
            print(f"{name:38} {p / 1e3:10.1f} {r / 1e3:10.1f} {(p - r) / 1e3:12.1f}")
    finally:
        tier.close()
        if a.dir is None:
            for f in os.listdir(d):
                os.remove(os.path.join(d, f))
            os.rmdir(d)


if __name__ == "__main__":
    main()
