#!/bin/bash
# Sixth GPU pass: the staged HBM path's copies (scatter into paged HBM blocks, gather with
# crc32c on the GPU) beside the pinned H2D ceiling, and every GPU test.
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
for t in 4096 65536; do
  step "staging_$t" 60 $G/gpu_bench staging --tokens $t --reps 21 >> "$O/staging.txt" 2>&1
done
grep "^FIG" "$O/staging.txt" >> "$S"
step gpu_tests 120 $G/gpu-tests --include-ignored --test-threads=1 --nocapture > "$O/tests.txt" 2>&1
grep -E "^test |test result" "$O/tests.txt" | sed 's/^/FIG /' >> "$S"
fig "done left_s=$(left)"
