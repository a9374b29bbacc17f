#!/bin/bash
# Tenth GPU pass (issue 24, one call): the serving path into HBM and time to first token.
#   1. the staged path's GPU tests (both layouts, bytes after a round trip from random HBM
#      into cleared HBM, layer events in order, a compute stream waiting per layer), the
#      GPU tests, and the Python CUDA-tensor tests from the carried wheel;
#   2. `kvtier bench --memory gpu`, 3 rounds per layout: staged restore and store beside
#      disk alone and pinned H2D alone of the same run, the GPU crc32c's share of a store;
#      the per-layer runs also through the node's service (--service), same run;
#   3. scripts/gpu/ttft.py: TTFT of recompute / kvtier restore under the suffix's layers /
#      prefix in HBM, llama3-8b and llama3-70b (as many layers as fit), 8K and 32K prefixes.
# Each part writes its raw output to $OUT as it finishes (a timeout keeps what was done).
# $BIN (default .gpu/) holds, built here without a GPU and stripped:
#   kvtier, gpu-staged-tests, gpu-tests (release; see pass8.sh) and the abi3 wheel
#   ((cd python && maturin build --release --strip -o ../.gpu) with nvcc on PATH).
# PARTS (default "1 2 3") picks parts and their order; TTFT_ARGS adds ttft.py arguments.
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
fig "host=$(nproc) cpus, $(free -g | awk '/Mem:/{print $2}') GiB, kernel $(uname -r)"
fig "python=$(python3 -c 'import sys,torch,transformers;print(sys.version.split()[0],"torch",torch.__version__,"transformers",transformers.__version__)' 2>&1 | tail -1)"
D=; for c in "$PWD" /var/tmp /root /tmp; do case $(stat -f -c %T "$c" 2>/dev/null) in ext2/ext3|ext4|xfs|btrfs) D=$c/kvtier-data; break;; esac; done
[ -z "$D" ] && D=$PWD/kvtier-data; mkdir -p "$D"
fig "pool_dir=$D fs=$(stat -f -c %T "$D") dev=$(df --output=source "$D" | tail -1) free=$(df -h --output=avail "$D" | tail -1)"
W=$(ls $G/kvtier-*.whl 2>/dev/null | head -1)
SITE=$D/site; rm -rf "$SITE"; [ -n "$W" ] && python3 -m zipfile -e "$W" "$SITE" && fig "wheel=$(basename "$W")"
PARTS=${PARTS:-1 2 3}

part1() {
  step staged_tests 90 $G/gpu-staged-tests --include-ignored --test-threads=1 --nocapture > "$O/staged-tests.txt" 2>&1
  grep -E "^test |test result|panicked" "$O/staged-tests.txt" | sed 's/^/FIG staged /' >> "$S"
  step gpu_tests 60 $G/gpu-tests --include-ignored --test-threads=1 > "$O/gpu-tests.txt" 2>&1
  grep -E "test result|FAILED|panicked" "$O/gpu-tests.txt" | sed 's/^/FIG gpu-tests /' >> "$S"
  ( cd python/tests && export PYTHONPATH=$SITE TMPDIR=$D HF_HUB_OFFLINE=1 && step py_staged_gpu 60 \
      python3 -m pytest -v -rs -p no:cacheprovider --basetemp="$D/pytest" test_staged_gpu.py ) > "$O/py-gpu.txt" 2>&1
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$O/py-gpu.txt" | grep -v "^FIG" | sed 's/^/FIG py /' >> "$S"
}

part2() {
  # One round per invocation (a fresh pool each); 3 rounds, layouts alternating. The
  # per-layer runs also go through the node's service (--service: its staged client
  # beside the in-process path, same run), its slice in reserved huge pages as a
  # service host would have them (2.5 GiB for these contexts; given back after).
  hp0=$(cat /proc/sys/vm/nr_hugepages 2>/dev/null || echo 0)
  echo $((hp0 + 1400)) > /proc/sys/vm/nr_hugepages 2>/dev/null; fig "hugepages=$(cat /proc/sys/vm/nr_hugepages)"
  for r in 1 2 3; do
    for layout in per-layer cross-layer; do
      x=--service t=100 n=4; [ $layout = cross-layer ] && x=--cross-layer t=60 n=2
      step "hbm_${layout}_$r" $t $G/kvtier bench --memory gpu --model llama3-8b --contexts ${CONTEXTS:-4096,16384} \
        --capacity 6g --dir "$D/bench" $x --json "$O/hbm-$layout-$r.json" >> "$O/hbm.txt" 2>&1
      grep -E "^ +[0-9]+ " "$O/hbm.txt" | tail -$n | sed "s/^/FIG hbm $layout r$r: /" >> "$S"
    done
  done
  echo "$hp0" > /proc/sys/vm/nr_hugepages 2>/dev/null
}

part3() {
  # TTFT_S caps this part (when parts run after it); by default it takes what is left.
  l=$(left); [ "$l" -gt 20 ] && t=$((l - 10)) || t=$l; [ "${TTFT_S:-$t}" -lt "$t" ] && t=$TTFT_S
  ( export PYTHONPATH=$SITE HF_HUB_OFFLINE=1 && step ttft "$t" python3 scripts/gpu/ttft.py --dir "$D/ttft" --out "$O" \
      --budget-s $((t - 60)) ${TTFT_ARGS:-} ) > "$O/ttft.txt" 2>&1
  grep -E "^FIG ttft " "$O/ttft.txt" | grep -v "^FIG ttft rc=" >> "$S"
}

for p in $PARTS; do "part$p"; done
nvidia-smi --query-gpu=memory.used,temperature.gpu,clocks.sm --format=csv,noheader | sed 's/^/FIG end /' >> "$S"
rm -rf "$D"; fig "done left_s=$(left)"
