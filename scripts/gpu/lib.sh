# Shared by the GPU pass scripts (source it): timeboxed steps and FIG lines.
# Binaries in $BIN (default .gpu/), output in $OUT, the pass ends by $BUDGET_S seconds.
set -u; export RUST_BACKTRACE=1 KVTIER_REQUIRE_GPU=1 PYTHONUNBUFFERED=1
# The device tool brings back at most 8 files from $OUT: the pass writes into a work folder
# and packs it into $OUT/pass.tgz (beside a copy of summary.txt) when it exits.
G=${BIN:-.gpu}; O=/tmp/kvtier-gpu-work; rm -rf "$O"; mkdir -p "$O"; S=$O/summary.txt; END=$((SECONDS+${BUDGET_S:-540}))
DEST=${OUT:-/tmp/kvtier-gpu-out}; mkdir -p "$DEST"
trap 'cp "$S" "$DEST/summary.txt" 2>/dev/null; tar czf "$DEST/pass.tgz" -C "$O" . 2>/dev/null' EXIT
left() { echo $((END-SECONDS)); }
fig() { echo "FIG $*" | tee -a "$S"; }
# step NAME SECONDS CMD...: runs CMD under a timeout cut to what is left, then a FIG line with rc and time.
step() { local name=$1 t=$2; shift 2; local l; l=$(left); [ "$l" -lt 15 ] && { fig "$name SKIPPED(no time)"; return; }
         [ "$t" -gt "$l" ] && t=$l; local t0=$SECONDS; timeout -k 5 "$t" "$@"; local rc=$?; fig "$name rc=$rc s=$((SECONDS-t0))"; }
# kvtier's dlopen needs libcuda.so.1 on the loader path.
ldconfig -p | grep -q "libcuda\.so\.1" || export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
