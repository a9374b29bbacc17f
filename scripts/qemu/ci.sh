#!/bin/sh
# The QEMU NVMe lane: setup (idempotent), one static build of
# examples/nvme_guest.rs, then the suite against QEMU's controller in uio and
# vfio (emulated intel-iommu) modes, and uio again with mdts=3 (32 KiB
# transfers). Exit 0 only if every run printed RESULT: PASS.
# Extra: KVTIER_QEMU_BW=1 adds bandwidth runs (file and null-co backends).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
"$HERE/setup.sh"
TARGET=x86_64-unknown-linux-gnu
(cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" \
   cargo build --quiet --release --example nvme_guest --bin kvtier --target $TARGET)
export KVTIER_GUEST_BIN="$ROOT/target/$TARGET/release/examples/nvme_guest"
export KVTIER_CLI_BIN="$ROOT/target/$TARGET/release/kvtier"
rc=0
lane() {
  if "$@" > "${TMPDIR:-/tmp}/kvtier-qemu-lane.log" 2>&1; then
    grep -E '^(TEST|BW|ENGINE|RESULT)|^run.sh' "${TMPDIR:-/tmp}/kvtier-qemu-lane.log"
  else
    cat "${TMPDIR:-/tmp}/kvtier-qemu-lane.log"
    rc=1
  fi
}
lane "$HERE/run.sh" uio
lane "$HERE/run.sh" vfio
NVME_MDTS=3 lane "$HERE/run.sh" uio
if [ "${KVTIER_QEMU_BW:-0}" = 1 ]; then
  lane "$HERE/run.sh" uio --bw-secs,1,--bw-only
  NVME_DRIVE=driver=null-co,size=1G lane "$HERE/run.sh" uio --bw-secs,1,--bw-only
  lane "$HERE/run.sh" vfio --bw-secs,1,--bw-only
  NVME_DRIVE=driver=null-co,size=1G lane "$HERE/run.sh" vfio --bw-secs,1,--bw-only
fi
[ $rc = 0 ] && echo "QEMU NVMe lane: PASS" || echo "QEMU NVMe lane: FAIL"
exit $rc
