#!/bin/bash
# Fourth GPU pass: which host calls a resident I/O kernel blocks (lazy and eager module
# loading), the GPU tests again, the command rate three times with the CPU comparator
# beside each (medians for the README), isolation, the staged restore up to 64K tokens,
# and torch slack tables. Binaries in $BIN (default .gpu/).
. "$(dirname "$0")/lib.sh"
D=$PWD/kvtier-data; mkdir -p "$D"; fig "pool_dir=$D gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

step blocking_lazy 40 $G/gpu_bench blocking > "$O/blocking.txt" 2>&1
echo "--- CUDA_MODULE_LOADING=EAGER" >> "$O/blocking.txt"
CUDA_MODULE_LOADING=EAGER step blocking_eager 40 $G/gpu_bench blocking >> "$O/blocking.txt" 2>&1
grep -h "FIG\|^---" "$O/blocking.txt" >> "$S"

for t in gpu_engine_drives_the_simulated_controller stream_waits_on_a_counter_until_the_host_writes_it host_kv_memory_registers_and_translates; do
  echo "=== $t" >> "$O/tests.txt"; step "test:$t" 60 $G/gpu-tests --include-ignored --exact "$t" --test-threads=1 --nocapture >> "$O/tests.txt" 2>&1
done
grep "llama3-8b KV" "$O/tests.txt" | sed 's/^/FIG /' >> "$S"

for r in 1 2 3; do
  step "rate_$r" 60 $G/gpu_bench rate --io-sms 8 --null-on compute --p2p hbm --queues 1,2,4,8 --bs 4k,128k,512k --seconds 1 >> "$O/rate.txt" 2>&1
  step "cpu_$r" 30 $G/nvme-sim-tests tier --nocapture >> "$O/cpu.txt" 2>&1
done
grep -h "^FIG" "$O/rate.txt" >> "$S"; grep -h "ns host CPU per command" "$O/cpu.txt" | sed 's/^/FIG cpu: /' >> "$S"
step isolation 60 $G/gpu_bench isolation --io-sms 8 --queues 8 --bs 128k --reps 21 > "$O/isolation.txt" 2>&1
grep "^FIG" "$O/isolation.txt" >> "$S"
step restore 150 $G/gpu_bench restore --dir "$D" --model llama3-8b --contexts 4096,16384,65536 --reps 3 > "$O/restore.txt" 2>&1
grep "^FIG" "$O/restore.txt" >> "$S"
rm -rf "$D"; mkdir -p "$D"
rm -rf "$D"; fig "done left_s=$(left)"
