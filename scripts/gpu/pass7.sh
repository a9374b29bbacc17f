#!/bin/bash
# Seventh GPU pass: torch-measured slack tables (CUDA-graph timing) for the presets, each
# with its profiling wall time; the harness's own check first.
. "$(dirname "$0")/lib.sh"
fig "gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
D=$PWD/kvtier-data; mkdir -p "$D"
step torch_check 90 python3 profiler/torch_harness.py --check > "$O/torch.txt" 2>&1
grep -h "^ok\|torch_harness" "$O/torch.txt" | sed 's/^/FIG /' >> "$S"
for m in ${MODELS:-llama3-8b qwen3-8b glm4-9b qwen3-32b llama3-70b}; do
  t0=$SECONDS
  step "profile_$m" ${PER_MODEL_S:-150} $G/kvtier-profile --model $m --gpu h100 --compute torch --harness profiler/torch_harness.py \
    --inputs 512,2048,8192,32768 --prefixes 0,8192,32768,65536 --contexts 1024,8192,32768,131072 \
    --pool-dir "$D" --storage-seconds 3 --out "$O/$m.h100.json" --quiet >> "$O/torch.txt" 2>&1
  fig "torch_profile model=$m wall_s=$((SECONDS-t0))"
  grep -E "torch_harness: (prefill 1/|prefill 16/|decode 1/|decode 4/)" "$O/torch.txt" | tail -4 | sed "s/^/FIG $m: /" >> "$S"
done
rm -rf "$D"; fig "done left_s=$(left)"
