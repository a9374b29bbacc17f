#!/bin/sh
# One-time, idempotent setup of the QEMU NVMe lane (see scripts/qemu/run.sh):
#   packages (qemu-system-x86, busybox-static, cpio), the Debian guest kernel
#   package downloaded and unpacked (not installed), an uncompressed vmlinux
#   for fast PVH boot under TCG, and a 1 GiB backing file.
# Work dir: ${KVTIER_QEMU_DIR:-$HOME/.cache/kvtier-qemu}.
set -eu
W=${KVTIER_QEMU_DIR:-$HOME/.cache/kvtier-qemu}
mkdir -p "$W"
cd "$W"
export DEBIAN_FRONTEND=noninteractive
if ! command -v qemu-system-x86_64 >/dev/null || [ ! -x /bin/busybox ] || ! command -v cpio >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  $SUDO apt-get install -y --no-install-recommends qemu-system-x86 busybox-static cpio
fi
if [ ! -d kroot/boot ]; then
  rm -rf debs kroot.tmp && mkdir -p debs kroot.tmp
  (cd debs && apt-get download linux-image-amd64 &&
     apt-get download "$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image/{print $2; exit}')")
  dpkg -x "$(ls debs/linux-image-[0-9]*-amd64_*.deb | head -1)" kroot.tmp
  mv kroot.tmp kroot
fi
# Uncompressed ELF vmlinux: PVH direct boot, no XZ decompression under TCG.
if [ ! -f vmlinux ]; then
  python3 -c '
import lzma, glob
d = open(glob.glob("kroot/boot/vmlinuz-*")[0], "rb").read()
o = d.find(b"\xfd7zXZ\x00")
open("vmlinux.tmp", "wb").write(lzma.LZMADecompressor().decompress(d[o:]))'
  mv vmlinux.tmp vmlinux
fi
[ -f disk.img ] || truncate -s 1G disk.img
echo "kvtier qemu setup OK in $W ($(ls kroot/lib/modules))"
