#!/bin/bash
# Second GPU pass: probe (named steps), the GPU tests, the I/O kernel's command
# rate against the GPU-resident null controller, green-context isolation, the
# staged restore (io_uring -> pinned -> HBM) beside its ceilings, and the CPU
# per-command comparator, all in one run. Binaries in $BIN (default .gpu/).
. "$(dirname "$0")/lib.sh"
D=$PWD/kvtier-data; mkdir -p "$D"; fig "pool_dir=$D fs=$(stat -f -c %T "$D") gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"

PROBE_BUDGET_S=12 step probe 17 $G/probe > "$O/probe.txt" 2>&1
# Lazy module loading (the CUDA 12.2+ default) needs the device quiet to load a kernel on its
# first launch: with a resident kernel, that launch waits. EAGER loads every kernel up front.
CUDA_MODULE_LOADING=EAGER PROBE_BUDGET_S=30 step probe_eager 35 $G/probe > "$O/probe32.txt" 2>&1
grep -h "^PROBE [a-z_]*=" "$O/probe.txt" | grep -v step= | sed 's/^/FIG /' >> "$S"
grep -h "^PROBE" "$O/probe32.txt" | grep -E "hang_in|streams_not|wait_value|done" | sed 's/^/FIG eager: /' >> "$S"

for t in probe_describes_each_device module_launch_copy_and_event_timing stream_waits_on_a_counter_until_the_host_writes_it \
         green_split_runs_each_partition_on_its_own_sms host_bounce_region_is_gpu_addressable_and_copies_to_hbm \
         iomemory_register_of_a_normal_page_and_devicemap_register host_kv_memory_registers_and_translates \
         dma_buf_export_matches_the_device_attribute gpu_engine_drives_the_simulated_controller; do
  echo "=== $t" >> "$O/tests.txt"; step "test:$t" 60 $G/gpu-tests --include-ignored --exact "$t" --test-threads=1 --nocapture >> "$O/tests.txt" 2>&1
done

# (a) command rate: I/O kernel on 8 SMs; null controller on the other SMs, then on the same 8.
step rate_sgl 90 $G/gpu_bench rate --io-sms 8 --null-on compute --queues 1,2,4,8 --bs 4k,128k,512k --seconds 1 > "$O/rate.txt" 2>&1
step rate_sgl_p2p_hbm 90 $G/gpu_bench rate --io-sms 8 --null-on compute --p2p hbm --queues 1,2,4,8 --bs 4k,128k,512k --seconds 1 >> "$O/rate.txt" 2>&1
step rate_sgl_same_sms 45 $G/gpu_bench rate --io-sms 8 --null-on io --queues 1,8 --bs 4k,128k --seconds 1 >> "$O/rate.txt" 2>&1
step rate_prp 45 $G/gpu_bench rate --io-sms 8 --null-on compute --queues 1,8 --bs 4k,128k --seconds 1 --prp >> "$O/rate.txt" 2>&1
grep "^FIG" "$O/rate.txt" >> "$S"
# the comparator, same run: one CPU core building the same commands (nvme engine on the simulator)
step cpu_cmd 60 $G/nvme-sim-tests tier --nocapture > "$O/cpu.txt" 2>&1; grep "ns host CPU per command" "$O/cpu.txt" | sed 's/^/FIG cpu: /' >> "$S"

# (b) isolation
step isolation 90 $G/gpu_bench isolation --io-sms 8 --queues 8 --bs 128k --reps 15 > "$O/isolation.txt" 2>&1
grep "^FIG" "$O/isolation.txt" >> "$S"

# (c) staged restore beside disk alone and H2D alone; dd O_DIRECT as the disk reference
step restore 150 $G/gpu_bench restore --dir "$D" --model llama3-8b --contexts 4096,16384 --reps 3 > "$O/restore.txt" 2>&1
grep "^FIG" "$O/restore.txt" >> "$S"
step dd_write 40 dd if=/dev/urandom of="$D/dd.dat" bs=1M count=2048 oflag=direct > "$O/dd.txt" 2>&1
step dd_read 30 dd if="$D/dd.dat" of=/dev/null bs=1M iflag=direct >> "$O/dd.txt" 2>&1
grep copied "$O/dd.txt" | sed 's/^/FIG dd: /' >> "$S"
rm -rf "$D"; fig "done left_s=$(left)"
