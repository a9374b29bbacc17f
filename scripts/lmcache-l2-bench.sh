#!/usr/bin/env bash
# `lmcache bench l2` with kvtier against LMCache's own `fs` adapter with
# O_DIRECT, alternating in one run: kvtier, fs, kvtier, fs, ... (RUNS pairs),
# each run on a fresh pool / fresh directory (both adapters skip keys they
# already hold), 4096-aligned L1, verified round trips. Raw outputs go to
# OUT; summary.txt has per-run medians and the ratios (fs time / kvtier time:
# above 1 means kvtier is faster).
#   scripts/lmcache-l2-bench.sh OUT_DIR [SCRATCH_DIR]
# Env: RUNS (3), SETTLE_S (3: seconds after deleting a run's files), NUM_KEYS (8), DATA_KB (32768), ROUNDS (3), MODEL (llama3-8b),
# CHUNK (256), CAPACITY (2g), KVTIER_PARAMS (extra adapter_params JSON members,
# e.g. '"workers": 4'), V (the venv; default scripts/python-env.sh's).
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR [SCRATCH_DIR]}
SCRATCH=${2:-$(pwd)/.bench}
V=${V:-$(dirname "$0")/python-env.sh}
[ -x "$V/bin/lmcache" ] || V=$("$(dirname "$0")/python-env.sh")
RUNS=${RUNS:-3} NUM_KEYS=${NUM_KEYS:-8} DATA_KB=${DATA_KB:-32768} ROUNDS=${ROUNDS:-3}
MODEL=${MODEL:-llama3-8b} CHUNK=${CHUNK:-256} CAPACITY=${CAPACITY:-2g}
EXTRA=${KVTIER_PARAMS:+, $KVTIER_PARAMS}
mkdir -p "$OUT" "$SCRATCH"
common=(--num-keys "$NUM_KEYS" --data-size-kb "$DATA_KB" --rounds "$ROUNDS"
        --no-skip-verify --l1-align-bytes 4096)
{
  echo "date: $(date -u +%FT%TZ)"; echo "host: $(uname -r), $(nproc) cpus"
  echo "args: ${common[*]}"; echo "kvtier params: model=$MODEL chunk=$CHUNK capacity=$CAPACITY $EXTRA"
  "$V/bin/python" -c 'import lmcache, importlib.metadata as m; print("lmcache", m.version("lmcache"))'
} > "$OUT/env.txt"
# Deleting a run's files (GiBs of extents) makes the file system busy for a
# while: settle before each run so neither side pays for the other's cleanup.
settle() { rm -rf "$@"; sync; sleep "${SETTLE_S:-3}"; }
for i in $(seq 1 "$RUNS"); do
  settle "$SCRATCH/kvtier" "$SCRATCH/fs"; mkdir -p "$SCRATCH/fs"
  kv="{\"type\": \"native_plugin\", \"module_path\": \"kvtier.lmcache\", \"class_name\": \"KvtierL2\", \"adapter_params\": {\"path\": \"$SCRATCH/kvtier\", \"capacity\": \"$CAPACITY\", \"model\": \"$MODEL\", \"chunk_size\": $CHUNK$EXTRA}}"
  "$V/bin/lmcache" bench l2 --l2-adapter "$kv" "${common[@]}" > "$OUT/kvtier-$i.txt" 2>&1
  settle "$SCRATCH/kvtier"
  fs="{\"type\": \"fs\", \"base_path\": \"$SCRATCH/fs\", \"use_odirect\": true}"
  "$V/bin/lmcache" bench l2 --l2-adapter "$fs" "${common[@]}" > "$OUT/fs-$i.txt" 2>&1
  settle "$SCRATCH/fs"
done
"$V/bin/python" - "$OUT" "$RUNS" > "$OUT/summary.txt" <<'PY'
import re, statistics, sys
out, runs = sys.argv[1], int(sys.argv[2])
def p50(path, op):
    text = open(path).read()
    sec = text.split(f"- {op} -")[1]
    ok = int(re.search(r"Total success:\s+(\d+)", sec).group(1))
    total = int(re.search(r"Total keys:\s+(\d+)", sec).group(1))
    assert ok == total, f"{path}: {op} {ok}/{total} keys succeeded"
    return float(re.search(r"Duration p50 \(ms\):\s+([\d.]+)", sec).group(1))
for op in ("Store", "Load"):
    kv = [p50(f"{out}/kvtier-{i}.txt", op) for i in range(1, runs + 1)]
    fs = [p50(f"{out}/fs-{i}.txt", op) for i in range(1, runs + 1)]
    pairs = [f / k for k, f in zip(kv, fs)]
    print(f"{op}: kvtier p50 ms per run {kv}, fs {fs}")
    print(f"{op}: median kvtier {statistics.median(kv):.1f} ms, fs {statistics.median(fs):.1f} ms, "
          f"ratio fs/kvtier of medians {statistics.median(fs) / statistics.median(kv):.2f}x, "
          f"per pair {', '.join(f'{r:.2f}' for r in pairs)}")
PY
cat "$OUT/summary.txt"
