#!/bin/bash
# First run of kvtier on a GPU machine: bash firstrun.sh   (binaries in $BIN, results in $OUT)
# $BIN (default .gpu/) holds: gpu-tests, nvme-sim-tests, kvtier, kvtier-profile (stripped), probe (from probe.cu).
# Every step is timeboxed; the whole script ends by ~540 s. Output: at most 8 files in $OUT.
. "$(dirname "$0")/lib.sh"

# 0. Facts (env.txt). libcuda must be on the loader path for kvtier's dlopen.
{ date; uname -a; head -2 /etc/os-release; nproc; free -g; nvidia-smi; nvidia-smi -q | grep -iE "driver version|cuda version|persistence|compute mode|mig mode|bar1|link (gen|width)|clocks_throttle|addressing"
  echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"; ldconfig -p | grep -E "libcuda\.so"; ls -l /dev/nvidia*; cat /proc/driver/nvidia/version
  lspci -vvv -d 10de: 2>/dev/null | grep -iE "AtomicOps|LnkSta:|DevCtl2"; df -T / /tmp /var/tmp "$PWD"; lsblk -o NAME,SIZE,ROTA,MODEL,TYPE,SCHED
  grep -E "Huge|MemTotal" /proc/meminfo; cat /sys/kernel/mm/transparent_hugepage/enabled
  command -v fio dd nvcc ncu compute-sanitizer cuobjdump
  python3 -c "import torch,transformers;print('torch',torch.__version__,'transformers',transformers.__version__,torch.cuda.get_device_name(),'green_contexts',hasattr(torch.cuda,'green_contexts'))"
} > "$O/env.txt" 2>&1
ldconfig -p | grep -q "libcuda\.so\.1" || export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# A directory on a real block device (O_DIRECT works; tmpfs/overlay do not count).
D=; for c in "$PWD" /var/tmp /root /tmp; do case $(stat -f -c %T "$c" 2>/dev/null) in ext2/ext3|ext4|xfs|btrfs) D=$c/kvtier-data; break;; esac; done
[ -z "$D" ] && D=$PWD/kvtier-data; mkdir -p "$D"; fig "pool_dir=$D fs=$(stat -f -c %T "$D")"

# 1. doctor (what kvtier itself sees).
step doctor 30 $G/kvtier doctor --json --dir "$D" > "$O/doctor.json" 2>&1

# 2. first-run unknowns: timer, PCIe latency, which calls block under a resident kernel, false deps, waits, sys atomics.
step probe 60 $G/probe > "$O/probe.txt" 2>&1; grep "^PROBE" "$O/probe.txt" | sed 's/^/FIG /' >> "$S"

# 3. the GPU tests, one per process (a hang costs 90 s, not the call), riskiest last.
for t in probe_describes_each_device module_launch_copy_and_event_timing stream_waits_on_a_counter_until_the_host_writes_it \
         green_split_runs_each_partition_on_its_own_sms host_bounce_region_is_gpu_addressable_and_copies_to_hbm \
         iomemory_register_of_a_normal_page_and_devicemap_register host_kv_memory_registers_and_translates \
         dma_buf_export_matches_the_device_attribute gpu_engine_drives_the_simulated_controller; do
  echo "=== $t" >> "$O/tests.txt"; step "test:$t" 90 $G/gpu-tests --include-ignored --exact "$t" --test-threads=1 --nocapture >> "$O/tests.txt" 2>&1
done
grep -E "llama3-8b KV|io [0-9]+ compute|distinct SMs" "$O/tests.txt" | sed 's/^/FIG /' >> "$S"
nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$O/tests.txt" 2>&1   # nothing may be left resident

# 4. CPU per-command cost on this host (the comparator for the GPU issue rate).
step cpu_cmd 60 $G/nvme-sim-tests tier --nocapture > "$O/bench.txt" 2>&1; grep "ns host CPU per command" "$O/bench.txt" | sed 's/^/FIG cpu: /' >> "$S"

# 5. staged-path ceilings: pinned/pageable H2D (torch, events), then the disk through kvtier (and fio/dd).
step h2d 60 python3 - >> "$O/bench.txt" 2>&1 <<'EOF'
import torch
for mb in (1, 16, 256, 1024):
    n = mb << 20; d = torch.empty(n, dtype=torch.uint8, device="cuda")
    for pin in (True, False):
        h = torch.empty(n, dtype=torch.uint8, pin_memory=pin); d.copy_(h, non_blocking=True); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True); s.record()
        for _ in range(10): d.copy_(h, non_blocking=True)
        e.record(); e.synchronize(); print(f"FIG h2d {'pinned' if pin else 'pageable'} {mb} MiB: {10*n/s.elapsed_time(e)/1e6:.1f} GB/s")
EOF
grep "^FIG h2d p" "$O/bench.txt" >> "$S"
step disk_read 90 $G/kvtier bench --dir "$D" --pattern read --bs 1m --iodepth 16 --size 2g --runtime 8 --repeat 2 $(command -v fio >/dev/null && echo --against-fio) >> "$O/bench.txt" 2>&1
step disk_randread 60 $G/kvtier bench --dir "$D" --pattern randread --bs 80k --iodepth 32 --size 2g --runtime 5 >> "$O/bench.txt" 2>&1
f=$(ls -S "$D" 2>/dev/null | head -1); [ -n "$f" ] && step dd_direct 30 dd if="$D/$f" of=/dev/null bs=1M count=2048 iflag=direct >> "$O/bench.txt" 2>&1
grep -E "^(kvtier|fio) +(rand)?read|kvtier/fio|copied" "$O/bench.txt" | sed 's/^/FIG disk: /' >> "$S"

# 6. torch slack table, reduced grid; wall time is the "how long profiling takes" figure.
step torch_check 60 python3 profiler/torch_harness.py --check --config x --inputs 1 --prefixes 0 --contexts 1 > "$O/torch.txt" 2>&1
t0=$SECONDS; step torch_profile 150 $G/kvtier-profile --model llama3-8b --gpu h100 --compute torch --harness profiler/torch_harness.py \
  --inputs 512,2048,8192 --prefixes 0,8192,32768 --contexts 1024,8192,32768 --pool-dir "$D" --storage-seconds 3 \
  --torch-arg=--repeats=3 --out "$O/llama3-8b.h100.json" >> "$O/torch.txt" 2>&1
fig "torch_profile_wall_s=$((SECONDS-t0)) points=9+3"
grep -E "prefill [0-9]+/|decode [0-9]+/" "$O/torch.txt" | tail -4 | sed 's/^/FIG torch: /' >> "$S"
rm -rf "$D"; fig "done left_s=$(left)"
