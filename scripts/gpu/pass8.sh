#!/bin/bash
# Eighth GPU pass: the staged HBM path end to end. The staged-path tests on device memory
# (round trip both layouts, round-robin layer buffers and back-pressure, bounded store
# staging, a corrupt block caught, a compute stream waiting per layer on the GPU), then
# `kvtier bench --memory gpu` (staged restore and store beside the disk-alone and
# copy-alone ceilings of the same run; the GPU crc32c's share of a store), 3 rounds per
# layout for medians.
# $BIN (default .gpu/) holds, built here without a GPU and stripped:
#   kvtier            cargo build --release --bin kvtier
#   gpu-staged-tests  the binary `cargo test --release --test gpu_staged --no-run` names
#   gpu-tests         the binary `cargo test --release --test gpu --no-run` names
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
D=; for c in "$PWD" /var/tmp /root /tmp; do case $(stat -f -c %T "$c" 2>/dev/null) in ext2/ext3|ext4|xfs|btrfs) D=$c/kvtier-data; break;; esac; done
[ -z "$D" ] && D=$PWD/kvtier-data; mkdir -p "$D"; fig "pool_dir=$D fs=$(stat -f -c %T "$D")"
step doctor 30 $G/kvtier doctor --dir "$D" > "$O/doctor.txt" 2>&1
grep -A2 "^memory" "$O/doctor.txt" | sed 's/^/FIG /' >> "$S"
step staged_tests 150 $G/gpu-staged-tests --include-ignored --test-threads=1 --nocapture > "$O/tests.txt" 2>&1
grep -E "^test |test result|panicked" "$O/tests.txt" | sed 's/^/FIG /' >> "$S"
for r in 1 2 3; do
  for layout in per-layer cross-layer; do
    x=; [ $layout = cross-layer ] && x=--cross-layer
    step "hbm_${layout}_$r" 100 $G/kvtier bench --memory gpu --model ${MODEL:-llama3-8b} --contexts ${CONTEXTS:-4096,16384,65536} \
      --capacity ${CAPACITY:-48g} --dir "$D" $x --json "$O/hbm-$layout-$r.json" >> "$O/hbm.txt" 2>&1
    grep -E "^ +[0-9]+ " "$O/hbm.txt" | tail -3 | sed "s/^/FIG hbm $layout r$r: /" >> "$S"
  done
done
[ -x $G/gpu-tests ] && { step gpu_tests 120 $G/gpu-tests --include-ignored --test-threads=1 --nocapture > "$O/gpu-tests.txt" 2>&1
  grep -E "test result" "$O/gpu-tests.txt" | sed 's/^/FIG gpu-tests /' >> "$S"; }
rm -rf "$D"; fig "done left_s=$(left)"
