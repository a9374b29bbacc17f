#!/bin/sh
# kvtier as the L2 of LMCache 0.5.6's server: the command of README.md's
# "Use with LMCache" section, which python/tests/test_lmcache.py runs (with
# a tiny model and pool) and checks the README against. Arguments are
# passed on to `lmcache server` (ports, ...).
exec lmcache server --l1-size-gb "${L1_GB:-32}" --eviction-policy LRU \
  --chunk-size "${CHUNK:-256}" --l2-adapter '{"type": "native_plugin",
    "module_path": "kvtier.lmcache", "class_name": "KvtierL2",
    "max_capacity_gb": '"${L2_GB:-60}"', "eviction": {"eviction_policy": "LRU"},
    "adapter_params": {"path": "'"${POOL:-/data/kvtier}"'", "capacity": "'"${CAPACITY:-64g}"'",
                       "model": "'"${MODEL:-llama3-8b}"'", "chunk_size": '"${CHUNK:-256}"'}}' "$@"
