#!/bin/sh
# Runs the userspace NVMe suite (examples/nvme_guest.rs) against QEMU's
# emulated NVMe controller in a TCG guest. Needs scripts/qemu/setup.sh once.
#
# usage: scripts/qemu/run.sh [uio|vfio] [comma-separated nvme_guest args]
# env:   KVTIER_QEMU_DIR  work dir (default ~/.cache/kvtier-qemu)
#        NVME_MDTS=N      -device nvme,mdts=N (e.g. 3: 32 KiB transfers)
#        NVME_DRIVE=...   QEMU -drive spec (default file=disk.img,format=raw;
#                         e.g. driver=null-co,size=1G for no storage)
#        KVTIER_GUEST_BIN a prebuilt static nvme_guest (else cargo builds it,
#                         and the kvtier CLI with it)
#        KVTIER_CLI_BIN   a static kvtier CLI for the guest (its `nvme bind`
#                         is tested there when present)
#        TIMEOUT=seconds  QEMU wall-clock limit (default 300)
# Exit 0 only if the guest printed "RESULT: PASS".
set -eu
MODE=${1:-uio}
ARGS=${2:-}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
W=${KVTIER_QEMU_DIR:-$HOME/.cache/kvtier-qemu}
[ -f "$W/vmlinux" ] && [ -d "$W/kroot/lib/modules" ] || { echo "run.sh: no guest kernel in $W: run scripts/qemu/setup.sh first" >&2; exit 2; }
case $MODE in uio|vfio) ;; *) echo "run.sh: mode must be uio or vfio" >&2; exit 2 ;; esac

TARGET=x86_64-unknown-linux-gnu
if [ -z "${KVTIER_GUEST_BIN:-}" ]; then
  (cd "$ROOT" && RUSTFLAGS="-C target-feature=+crt-static" \
     cargo build --quiet --release --example nvme_guest --bin kvtier --target $TARGET)
  KVTIER_GUEST_BIN=$ROOT/target/$TARGET/release/examples/nvme_guest
  KVTIER_CLI_BIN=${KVTIER_CLI_BIN:-$ROOT/target/$TARGET/release/kvtier}
fi

# initramfs: busybox, the guest binary, the kernel nvme driver (with its
# dependencies, in load order: nvme-core needs t10-pi, which needs crc-t10dif
# and crc64-rocksoft; their crypto backends ride along so nothing has to be
# requested through modprobe, which the guest lacks), uio/vfio modules, init.
KV=$(ls "$W/kroot/lib/modules" | head -1)
KM=$W/kroot/lib/modules/$KV/kernel
I=$W/initrd.$$
rm -rf "$I" && mkdir -p "$I/bin" "$I/lib/modules"
cp /bin/busybox "$I/bin/busybox"
cp "$KVTIER_GUEST_BIN" "$I/bin/nvme_guest"
if [ -n "${KVTIER_CLI_BIN:-}" ]; then cp "$KVTIER_CLI_BIN" "$I/bin/kvtier"; fi
cp "$ROOT/scripts/qemu/init" "$I/init" && chmod +x "$I/init"
for m in crypto/crct10dif_common.ko crypto/crct10dif_generic.ko lib/crc-t10dif.ko \
         lib/crc64.ko crypto/crc64_rocksoft_generic.ko lib/crc64-rocksoft.ko block/t10-pi.ko \
         drivers/nvme/host/nvme-core.ko drivers/nvme/host/nvme.ko \
         drivers/uio/uio.ko drivers/uio/uio_pci_generic.ko \
         drivers/vfio/vfio.ko drivers/vfio/vfio_iommu_type1.ko drivers/vfio/vfio_virqfd.ko \
         virt/lib/irqbypass.ko drivers/vfio/pci/vfio-pci-core.ko drivers/vfio/pci/vfio-pci.ko; do
  cp "$KM/$m" "$I/lib/modules/"
done
(cd "$I" && find . | cpio -o -H newc --quiet | gzip -1 > "$W/initrd-$MODE.$$.cpio.gz")
rm -rf "$I"
INITRD=$W/initrd-$MODE.$$.cpio.gz

[ -f "$W/disk.img" ] || truncate -s 1G "$W/disk.img"
if [ "$MODE" = vfio ]; then
  MACH="-machine q35,accel=tcg,kernel-irqchip=split -device intel-iommu,intremap=on"
  KAPPEND="intel_iommu=on"
else
  MACH="-machine q35,accel=tcg"
  KAPPEND=""
fi
NVME="nvme,serial=kvtier0001,drive=d0${NVME_MDTS:+,mdts=$NVME_MDTS}"
LOG=$W/run-$MODE.$$.log
echo "run.sh: $MODE, -device $NVME, drive ${NVME_DRIVE:-file=disk.img,format=raw}, args '${ARGS}'"
START=$(date +%s.%N)
set +e
(cd "$W" && timeout "${TIMEOUT:-300}" qemu-system-x86_64 $MACH -cpu max -smp "${SMP:-2}" -m 1G \
  -nodefaults -no-user-config -nographic -serial stdio -no-reboot \
  -kernel vmlinux -initrd "$INITRD" \
  -append "console=ttyS0 quiet loglevel=4 panic=-1 $KAPPEND kvtier.mode=$MODE kvtier.args=$ARGS" \
  -drive "${NVME_DRIVE:-file=disk.img,format=raw},if=none,id=d0" \
  -device "$NVME" </dev/null 2>&1) | tr -d '\r' | tee "$LOG"
set -e
END=$(date +%s.%N)
rm -f "$INITRD"
SECS=$(echo "$END $START" | awk '{printf "%.1f", $1 - $2}')
if grep -q '^RESULT: PASS' "$LOG"; then
  echo "run.sh: $MODE PASS in ${SECS}s (log $LOG)"
  exit 0
fi
echo "run.sh: $MODE FAIL in ${SECS}s (log $LOG)" >&2
exit 1
