//! What the first bytes of a device say it holds: filesystem, partition-table and volume
//! signatures (the magics blkid looks for), so that kvtier never formats over someone's data.

use std::fmt;
use std::fs::File;
use std::io::{self, ErrorKind};
use std::os::unix::fs::FileExt;

/// Magic at byte 0 of every kvtier pool device (the superblock starts there).
pub const POOL_MAGIC: [u8; 8] = *b"KVTIERPL";

/// Magic at byte 0 of a device while `kvtier pool create` formats it: written (durably)
/// over the old superblock before anything else, replaced by the superblock last. A
/// device still carrying it holds no pool: a create was killed or failed part way.
pub const UNFINISHED_MAGIC: [u8; 8] = *b"KVTIERFM";

/// How many leading bytes of a device [`probe_signature`] looks at: 256 KiB, enough for
/// btrfs (magic at 64 KiB + 64), iso9660/udf (32 KiB + 1) and the ZFS uberblock ring of
/// vdev label 0 (128 KiB .. 256 KiB).
pub const SIGNATURE_PROBE_BYTES: usize = 256 * 1024;

/// What the first bytes of a device say it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Signature {
    /// Every probed byte is zero (or the device is empty).
    Empty,
    /// Begins with [`POOL_MAGIC`].
    KvtierPool,
    /// Begins with [`UNFINISHED_MAGIC`]: a kvtier create that did not finish.
    KvtierUnfinished,
    /// A recognised filesystem, partition table or volume signature. The name is one of
    /// "ext2/3/4", "xfs", "btrfs", "swap", "vfat", "exfat", "ntfs", "iso9660", "udf",
    /// "squashfs", "f2fs", "zfs", "LVM2 PV", "LUKS", "linux_raid_member", "bcache",
    /// "GPT partition table", "dos partition table".
    Filesystem(&'static str),
    /// Non-zero data kvtier does not recognise.
    Unknown,
}

impl fmt::Display for Signature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Signature::Empty => f.write_str("nothing (its first bytes are all zero)"),
            Signature::KvtierPool => f.write_str("a kvtier pool"),
            Signature::KvtierUnfinished => f.write_str(
                "a kvtier pool create that did not finish: it was killed or failed part way",
            ),
            Signature::Unknown => f.write_str("data kvtier does not recognise"),
            Signature::Filesystem(name) => {
                let text = match *name {
                    "ext2/3/4" => "an ext2/3/4 filesystem",
                    "xfs" => "an xfs filesystem",
                    "btrfs" => "a btrfs filesystem",
                    "swap" => "a swap area",
                    "vfat" => "a vfat filesystem",
                    "exfat" => "an exfat filesystem",
                    "ntfs" => "an ntfs filesystem",
                    "iso9660" => "an iso9660 filesystem",
                    "udf" => "a udf filesystem",
                    "squashfs" => "a squashfs filesystem",
                    "f2fs" => "an f2fs filesystem",
                    "zfs" => "a zfs pool member",
                    "LVM2 PV" => "an LVM2 physical volume",
                    "LUKS" => "a LUKS encrypted volume",
                    "linux_raid_member" => "a Linux md RAID member",
                    "bcache" => "a bcache device",
                    "GPT partition table" => "a GPT partition table",
                    "dos partition table" => "a dos partition table",
                    other => return write!(f, "a {other} signature"),
                };
                f.write_str(text)
            }
        }
    }
}

/// The id of the pool whose create left `head`'s unfinished mark (the 16 bytes after
/// [`UNFINISHED_MAGIC`]), if it carries one.
pub fn unfinished_pool_id(head: &[u8]) -> Option<[u8; 16]> {
    if !magic_at(head, 0, &UNFINISHED_MAGIC) {
        return None;
    }
    head.get(8..24)?.try_into().ok()
}

/// Does `head` hold `magic` at `offset`? False when `head` is too short.
fn magic_at(head: &[u8], offset: usize, magic: &[u8]) -> bool {
    head.get(offset..offset + magic.len()) == Some(magic)
}

fn u32_le_at(head: &[u8], offset: usize) -> Option<u32> {
    let bytes = head.get(offset..offset + 4)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

fn u64_at(head: &[u8], offset: usize) -> Option<[u8; 8]> {
    head.get(offset..offset + 8)?.try_into().ok()
}

/// Inspect the first bytes of a device (up to [`SIGNATURE_PROBE_BYTES`]; a shorter slice
/// is fine, magics beyond its end are simply not seen) and say what they hold.
///
/// Specific magics are checked before generic ones: a FAT, NTFS or iso9660 boot sector
/// also carries the 0x55AA MBR boot signature, so the dos partition table comes last.
pub fn probe_signature(head: &[u8]) -> Signature {
    if magic_at(head, 0, &POOL_MAGIC) {
        return Signature::KvtierPool;
    }
    if magic_at(head, 0, &UNFINISHED_MAGIC) {
        return Signature::KvtierUnfinished;
    }
    if let Some(name) = recognised_signature(head) {
        return Signature::Filesystem(name);
    }
    if head.iter().all(|&b| b == 0) {
        Signature::Empty
    } else {
        Signature::Unknown
    }
}

fn recognised_signature(head: &[u8]) -> Option<&'static str> {
    const MD_MAGIC: u32 = 0xa92b_4efc;
    const BCACHE_MAGIC: [u8; 16] = [
        0xc6, 0x85, 0x73, 0xf6, 0x4e, 0x1a, 0x45, 0xca, 0x82, 0x65, 0xf5, 0x7f, 0x48, 0xba, 0x6d,
        0x81,
    ];
    const ZFS_UBERBLOCK_MAGIC: u64 = 0x00ba_b10c;

    // Magics at byte 0.
    if magic_at(head, 0, b"LUKS\xba\xbe") {
        return Some("LUKS");
    }
    if magic_at(head, 0, b"XFSB") {
        return Some("xfs");
    }
    if magic_at(head, 0, b"hsqs") {
        return Some("squashfs");
    }
    // md superblock 1.1 at 0, 1.2 at 4 KiB.
    if u32_le_at(head, 0) == Some(MD_MAGIC) || u32_le_at(head, 4096) == Some(MD_MAGIC) {
        return Some("linux_raid_member");
    }
    // LVM2 label: "LABELONE" in one of the first four 512-byte sectors, usually the second.
    if (0..4).any(|sector| magic_at(head, sector * 512, b"LABELONE")) {
        return Some("LVM2 PV");
    }
    // GPT header in LBA 1: byte 512 for 512-byte sectors, 4096 for 4Kn disks.
    if magic_at(head, 512, b"EFI PART") || magic_at(head, 4096, b"EFI PART") {
        return Some("GPT partition table");
    }
    // OEM names in the boot sector.
    if magic_at(head, 3, b"NTFS    ") {
        return Some("ntfs");
    }
    if magic_at(head, 3, b"EXFAT   ") {
        return Some("exfat");
    }
    let boot_signature = magic_at(head, 510, &[0x55, 0xaa]);
    if magic_at(head, 82, b"FAT32   ")
        || (boot_signature
            && (magic_at(head, 54, b"FAT12   ")
                || magic_at(head, 54, b"FAT16   ")
                || magic_at(head, 54, b"FAT     ")))
    {
        return Some("vfat");
    }
    // ext2/3/4: s_magic 0xEF53 (little-endian) at 1024 + 56.
    if magic_at(head, 1080, &[0x53, 0xef]) {
        return Some("ext2/3/4");
    }
    // f2fs: 0xF2F52010 (little-endian) at 1024.
    if u32_le_at(head, 1024) == Some(0xf2f5_2010) {
        return Some("f2fs");
    }
    if magic_at(head, 4096 + 24, &BCACHE_MAGIC) {
        return Some("bcache");
    }
    // swap: the last 10 bytes of the first page, for each page size Linux uses.
    for page in [4096usize, 8192, 16384, 65536] {
        if magic_at(head, page - 10, b"SWAPSPACE2") || magic_at(head, page - 10, b"SWAP-SPACE") {
            return Some("swap");
        }
    }
    // ISO 9660 / UDF volume descriptors at 32 KiB (identifier after the type byte).
    if magic_at(head, 32769, b"CD001") {
        return Some("iso9660");
    }
    if magic_at(head, 32769, b"BEA01")
        || magic_at(head, 32769, b"NSR02")
        || magic_at(head, 32769, b"NSR03")
    {
        return Some("udf");
    }
    // btrfs: superblock at 64 KiB, magic at +64.
    if magic_at(head, 65536 + 64, b"_BHRfS_M") {
        return Some("btrfs");
    }
    // ZFS: the uberblock ring of vdev label 0 (128 KiB .. 256 KiB), 1 KiB slots or larger,
    // magic in either byte order.
    let mut slot = 128 * 1024;
    while slot < 256 * 1024 {
        if let Some(bytes) = u64_at(head, slot) {
            if u64::from_le_bytes(bytes) == ZFS_UBERBLOCK_MAGIC
                || u64::from_be_bytes(bytes) == ZFS_UBERBLOCK_MAGIC
            {
                return Some("zfs");
            }
        }
        slot += 1024;
    }
    // DOS MBR: boot signature plus at least one used partition entry whose boot flag is
    // 0x00 or 0x80 (boot code in a FAT/NTFS boot sector rarely passes this).
    if boot_signature {
        let entries: Vec<&[u8]> = (0..4)
            .filter_map(|i| head.get(446 + 16 * i..446 + 16 * (i + 1)))
            .collect();
        let flags_ok = entries.iter().all(|e| e[0] == 0x00 || e[0] == 0x80);
        let any_used = entries.iter().any(|e| e[4] != 0);
        if entries.len() == 4 && flags_ok && any_used {
            return Some("dos partition table");
        }
    }
    None
}

/// Read up to [`SIGNATURE_PROBE_BYTES`] from the start of `file` (which must not be in
/// O_DIRECT mode yet) for [`probe_signature`].
pub(crate) fn read_head(file: &File, len: u64) -> io::Result<Vec<u8>> {
    let want = usize::try_from(len.min(SIGNATURE_PROBE_BYTES as u64)).unwrap_or(0);
    let mut head = vec![0u8; want];
    let mut done = 0;
    while done < want {
        match file.read_at(&mut head[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    head.truncate(done);
    Ok(head)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head_with(offset: usize, magic: &[u8]) -> Vec<u8> {
        let mut head = vec![0u8; SIGNATURE_PROBE_BYTES];
        head[offset..offset + magic.len()].copy_from_slice(magic);
        head
    }

    #[test]
    fn probe_recognises_each_magic() {
        let fs = |name| Signature::Filesystem(name);
        let cases: Vec<(Vec<u8>, Signature)> = vec![
            (head_with(0, &POOL_MAGIC), Signature::KvtierPool),
            (head_with(1080, &[0x53, 0xef]), fs("ext2/3/4")),
            (head_with(0, b"XFSB"), fs("xfs")),
            (head_with(65600, b"_BHRfS_M"), fs("btrfs")),
            (head_with(4086, b"SWAPSPACE2"), fs("swap")),
            (head_with(4086, b"SWAP-SPACE"), fs("swap")),
            (head_with(65526, b"SWAPSPACE2"), fs("swap")),
            (head_with(82, b"FAT32   "), fs("vfat")),
            (head_with(3, b"NTFS    "), fs("ntfs")),
            (head_with(3, b"EXFAT   "), fs("exfat")),
            (head_with(32769, b"CD001"), fs("iso9660")),
            (head_with(32769, b"BEA01"), fs("udf")),
            (
                head_with(512, b"LABELONE\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0LVM2 001"),
                fs("LVM2 PV"),
            ),
            (head_with(0, b"LUKS\xba\xbe\0\x02"), fs("LUKS")),
            (head_with(512, b"EFI PART"), fs("GPT partition table")),
            (head_with(4096, b"EFI PART"), fs("GPT partition table")),
            (head_with(0, b"hsqs"), fs("squashfs")),
            (head_with(1024, &0xf2f5_2010u32.to_le_bytes()), fs("f2fs")),
            (
                head_with(4096, &0xa92b_4efcu32.to_le_bytes()),
                fs("linux_raid_member"),
            ),
            (
                head_with(128 * 1024 + 4096, &0x00ba_b10cu64.to_le_bytes()),
                fs("zfs"),
            ),
            (
                head_with(128 * 1024, &0x00ba_b10cu64.to_be_bytes()),
                fs("zfs"),
            ),
        ];
        for (head, want) in cases {
            assert_eq!(probe_signature(&head), want);
        }

        // FAT12/16: name at 54 plus the boot signature.
        let mut fat16 = head_with(54, b"FAT16   ");
        fat16[510] = 0x55;
        fat16[511] = 0xaa;
        fat16[0] = 0xeb; // a jump instruction, like a real boot sector
        assert_eq!(probe_signature(&fat16), fs("vfat"));
        // ...but not without it.
        assert_eq!(
            probe_signature(&head_with(54, b"FAT16   ")),
            Signature::Unknown
        );
    }

    #[test]
    fn probe_dos_partition_table_and_ordering() {
        let mut mbr = vec![0u8; 4096];
        mbr[446 + 4] = 0x83; // one Linux partition
        mbr[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        mbr[510] = 0x55;
        mbr[511] = 0xaa;
        assert_eq!(
            probe_signature(&mbr),
            Signature::Filesystem("dos partition table")
        );

        // A boot signature with no used partition entry is not a partition table.
        let mut bare = vec![0u8; 4096];
        bare[510] = 0x55;
        bare[511] = 0xaa;
        assert_eq!(probe_signature(&bare), Signature::Unknown);

        // GPT's protective MBR (type 0xEE) is reported as GPT, not dos.
        let mut gpt = mbr.clone();
        gpt[446 + 4] = 0xee;
        gpt[512..520].copy_from_slice(b"EFI PART");
        assert_eq!(
            probe_signature(&gpt),
            Signature::Filesystem("GPT partition table")
        );

        // An isohybrid image (MBR + iso9660) is an iso9660 filesystem.
        let mut iso = head_with(32769, b"CD001");
        iso[..512].copy_from_slice(&mbr[..512]);
        assert_eq!(probe_signature(&iso), Signature::Filesystem("iso9660"));

        // A kvtier pool wins over leftovers of what was there before.
        let mut pool = head_with(65600, b"_BHRfS_M");
        pool[..8].copy_from_slice(&POOL_MAGIC);
        assert_eq!(probe_signature(&pool), Signature::KvtierPool);
    }

    #[test]
    fn probe_zeros_garbage_and_short_buffers() {
        assert_eq!(probe_signature(&[]), Signature::Empty);
        assert_eq!(
            probe_signature(&vec![0u8; SIGNATURE_PROBE_BYTES]),
            Signature::Empty
        );
        assert_eq!(probe_signature(&[0u8; 7]), Signature::Empty);
        assert_eq!(probe_signature(b"KVTIERP"), Signature::Unknown);
        assert_eq!(probe_signature(b"KVTIERPL"), Signature::KvtierPool);
        let garbage: Vec<u8> = (0..SIGNATURE_PROBE_BYTES)
            .map(|i| (i as u8).wrapping_mul(7) | 1)
            .collect();
        assert_eq!(probe_signature(&garbage), Signature::Unknown);
        let mut one = vec![0u8; 4096];
        one[4000] = 1;
        assert_eq!(probe_signature(&one), Signature::Unknown);
        // Every prefix length is safe (no out-of-bounds slicing).
        let ext = head_with(1080, &[0x53, 0xef]);
        for len in [0, 1, 511, 512, 1080, 1081, 1082, 4096, 65600, 65607] {
            let _ = probe_signature(&ext[..len]);
        }
        assert_eq!(
            probe_signature(&ext[..1082]),
            Signature::Filesystem("ext2/3/4")
        );
    }

    #[test]
    fn signature_display_names_the_thing() {
        assert_eq!(
            Signature::Filesystem("ext2/3/4").to_string(),
            "an ext2/3/4 filesystem"
        );
        assert_eq!(
            Signature::Filesystem("dos partition table").to_string(),
            "a dos partition table"
        );
        assert_eq!(Signature::KvtierPool.to_string(), "a kvtier pool");
    }
}
