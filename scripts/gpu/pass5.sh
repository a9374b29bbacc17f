#!/bin/bash
# Fifth GPU pass: isolation with acquire vs relaxed pollers (same run), the GPU tests
# (an idle engine does not hold cuMemFree), and the command rate three times with the CPU
# comparator beside each, after the relaxed polls and the SGL dry-run skip.
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
step isolation 60 $G/gpu_bench isolation --io-sms 8 --queues 8 --bs 128k --reps 21 > "$O/isolation.txt" 2>&1
grep "^FIG" "$O/isolation.txt" >> "$S"
step gpu_tests 120 $G/gpu-tests --include-ignored --test-threads=1 --nocapture > "$O/tests.txt" 2>&1
grep -E "^test |llama3-8b KV|held cuMemFree|test result" "$O/tests.txt" | sed 's/^/FIG /' >> "$S"
for r in 1 2 3; do
  step "rate_$r" 60 $G/gpu_bench rate --io-sms 8 --null-on compute --queues 1,2,4,8 --bs 4k,128k,512k --seconds 1 >> "$O/rate.txt" 2>&1
  step "cpu_$r" 30 $G/nvme-sim-tests tier --nocapture >> "$O/cpu.txt" 2>&1
done
grep -h "^FIG" "$O/rate.txt" >> "$S"; grep -h "ns host CPU per command" "$O/cpu.txt" | sed 's/^/FIG cpu: /' >> "$S"
fig "done left_s=$(left)"
