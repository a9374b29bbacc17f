#!/bin/bash
# Ninth GPU pass: CUDA torch tensors through the Python bindings (the staged HBM path
# from Python): python/tests/test_staged_gpu.py, i.e. store and load layer by layer
# into CUDA per-layer and block-major caches with host waits and with torch's current
# stream waiting per layer on the GPU counter (stream_wait_layer), bytes compared.
# The machine's python3 has torch but no network, cargo or (maybe) pytest: the test
# runs from a prebuilt wheel, under pytest if it imports, else as a plain script.
# $BIN (default .gpu/) holds the wheel, built here without a GPU (nvcc on PATH, so
# the kernels are in it):
#   (cd python && maturin build --release --strip -o ../.gpu)
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
fig "python=$(python3 -c 'import sys,torch;print(sys.version.split()[0],"torch",torch.__version__,"cuda",torch.cuda.is_available())' 2>&1)"
W=$(ls $G/kvtier-*.whl 2>/dev/null | head -1)
[ -z "$W" ] && { fig "no wheel in $G: build it with (cd python && maturin build --release --strip -o ../.gpu)"; exit 1; }
D=; for c in "$PWD" /var/tmp /root /tmp; do case $(stat -f -c %T "$c" 2>/dev/null) in ext2/ext3|ext4|xfs|btrfs) D=$c/kvtier-data; break;; esac; done
[ -z "$D" ] && D=$PWD/kvtier-data; mkdir -p "$D"; fig "pool_dir=$D fs=$(stat -f -c %T "$D")"
SITE=$D/site; rm -rf "$SITE"; python3 -m zipfile -e "$W" "$SITE" && fig "wheel=$(basename "$W")"
export PYTHONPATH=$SITE TMPDIR=$D HF_HUB_OFFLINE=1
cd python/tests
if python3 -c "import pytest" 2>/dev/null; then
  step py_staged_gpu 240 python3 -m pytest -v -rs -p no:cacheprovider --basetemp="$D/pytest" test_staged_gpu.py > "$O/py-staged-gpu.txt" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$O/py-staged-gpu.txt" | sed 's/^/FIG /' >> "$S"
else
  step py_staged_gpu 240 python3 test_staged_gpu.py > "$O/py-staged-gpu.txt" 2>&1
  grep -E "^(PASS|FAIL|SKIP) |passed or skipped" "$O/py-staged-gpu.txt" | sed 's/^/FIG /' >> "$S"
fi
cd - > /dev/null
rm -rf "$D"; fig "done left_s=$(left)"
