//! On-device layout of a pool: the superblock, extent groups, block headers.
//!
//! ```text
//! device:  [superblock 4 KiB][.. reserved to 1 MiB ..][group 0][group 1]...
//!          (reserved: backup superblocks at 256 KiB and 768 KiB, bad-slot table at 512 KiB)
//! group:   [header slot 0 .. header slot G-1]  G x 4 KiB
//!          [L0 K b0..bG-1][L0 V b0..bG-1][L1 K ...] ... [L(L-1) V b0..bG-1]
//! ```
//!
//! Within an extent group of G blocks the objects are ordered (layer, K|V,
//! block), so one layer of a run of consecutive blocks is one contiguous
//! extent (K run then V run), and a layer of a whole group is one I/O of
//! 2·G objects. Groups are numbered globally and dealt round-robin over the
//! devices, so consecutive groups, and the blocks stored together, stripe
//! across SSDs. Headers live at the front of their group, one 4 KiB sector
//! each, so a header write never shares a sector with another block's header
//! and rebuilding the index reads G·4 KiB per group in one I/O.

use crate::model::KvGeometry;
use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

pub(crate) const FORMAT_VERSION: u32 = 1;
/// `BlockHeader::version` of the headers this build writes.
pub(crate) const BLOCK_HEADER_VERSION: u16 = 1;
/// Where a device keeps copies of its superblock, each in its own 4 KiB
/// sector: the primary (a create's commit point) and backups inside the
/// reserved area, so one damaged sector never loses the pool. Pools made
/// before the backups (`Superblock::copies` 0) have only the primary.
pub const SUPERBLOCK_OFFSETS: [u64; 3] = [0, 256 << 10, 768 << 10];
/// Bytes reserved at the front of every device for the superblock.
pub const DATA_OFFSET: u64 = 1 << 20;
/// One block header per 4 KiB sector.
pub(crate) const SLOT_HEADER_BYTES: u64 = 4096;
pub(crate) const BLOCK_HEADER_MAGIC: [u8; 4] = *b"KVBH";
/// `BlockHeader::state` of a block whose data is durable and whole.
pub(crate) const BLOCK_STATE_LIVE: u32 = 1;
/// `BlockHeader::flags`: the block was stored from memory the host cannot
/// read (GPU memory), so `data_crc` is not set and `check` cannot verify it.
pub(crate) const BLOCK_FLAG_NO_DATA_CRC: u16 = 1;
/// `BlockHeader::flags`: the header sector also holds one crc32c per layer (of
/// the layer's K then V object) right after the header, so a load verifies each
/// layer as it lands rather than only the whole block.
pub(crate) const BLOCK_FLAG_LAYER_CRCS: u16 = 2;
/// Where the per-layer checksums start in a header sector.
pub(crate) const LAYER_CRCS_OFFSET: usize = 128;
/// The most layers whose checksums fit in a header sector; deeper models are
/// verified per block.
pub(crate) const MAX_LAYER_CRCS: u32 =
    ((SLOT_HEADER_BYTES as usize - LAYER_CRCS_OFFSET) / 4) as u32;
/// Where a device's table of retired (bad) slots lives, inside the reserved area
/// before the first group, and its size.
pub const BAD_TABLE_OFFSET: u64 = 512 << 10;
pub(crate) const BAD_TABLE_BYTES: usize = 64 << 10;
pub(crate) const BAD_TABLE_MAGIC: [u8; 8] = *b"KVBADSL1";
/// Slots one device's bad table can record (after its 32-byte head).
pub(crate) const BAD_TABLE_MAX: usize = (BAD_TABLE_BYTES - 32) / 8;
/// The longest namespace and model name a superblock records.
pub(crate) const NAMESPACE_MAX: usize = 128;
pub(crate) const MODEL_NAME_MAX: usize = 64;

/// The first 512 bytes of every pool device.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct Superblock {
    /// `POOL_MAGIC` ("KVTIERPL").
    pub magic: [u8; 8],
    /// Layout version.
    pub version: u32,
    /// `size_of::<Superblock>()`, so a reader knows the struct it parses.
    pub sb_bytes: u32,
    /// Random id shared by every device of the pool and every block header.
    pub pool_uuid: [u8; 16],
    /// This device's place in the pool.
    pub device_index: u32,
    /// Devices of the pool.
    pub device_count: u32,
    /// Bytes of this device the pool uses (never grows).
    pub device_size: u64,
    /// Byte offset of the first extent group.
    pub data_offset: u64,
    /// Blocks per extent group.
    pub group_blocks: u32,
    /// Extent groups on this device.
    pub groups_on_device: u32,
    /// Extent groups of the pool.
    pub total_groups: u32,
    /// Model layers.
    pub layers: u32,
    /// KV heads.
    pub kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// `DType::code`.
    pub dtype: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Bytes of one object.
    pub object_bytes: u64,
    /// Bytes of a slot's header sector.
    pub slot_header_bytes: u32,
    /// Bytes of `namespace` used.
    pub namespace_len: u32,
    /// The namespace.
    pub namespace: [u8; NAMESPACE_MAX],
    /// Bytes of `model` used.
    pub model_len: u32,
    /// Zero.
    pub pad0: u32,
    /// The model name.
    pub model: [u8; MODEL_NAME_MAX],
    /// Creation time, seconds since the epoch.
    pub created_unix: u64,
    /// How many of [`SUPERBLOCK_OFFSETS`] hold a copy of this superblock (0
    /// in pools made before the backups: the primary alone).
    pub copies: u32,
    /// Zero.
    pub reserved: [u8; 192],
    /// crc32c of every byte before it.
    pub crc: u32,
}

/// The header of one GPU file (block), in the first bytes of its 4 KiB
/// header sector.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable, PartialEq, Eq)]
pub struct BlockHeader {
    /// `BLOCK_HEADER_MAGIC`.
    pub magic: [u8; 4],
    /// Header version.
    pub version: u16,
    /// `BLOCK_FLAG_*`.
    pub flags: u16,
    /// Must equal the superblock's: a header left by an earlier pool on the
    /// same device is not ours.
    pub pool_uuid: [u8; 16],
    /// The slot this header describes (guards against misplaced writes).
    pub slot: u64,
    /// Pool-wide store counter: the newest copy of a key wins on rebuild.
    pub generation: u64,
    /// The key's bytes.
    pub key: [u8; 32],
    /// Bytes of `key` used.
    pub key_len: u8,
    /// Zero.
    pub pad0: [u8; 7],
    /// Hash of the pool namespace the key belongs to.
    pub namespace_hash: u64,
    /// Bytes of data (2L objects).
    pub data_len: u64,
    /// crc32c of the block's 2L objects in (layer, K|V) order.
    pub data_crc: u32,
    /// `BLOCK_STATE_LIVE`.
    pub state: u32,
    /// crc32c of the per-layer checksum table that follows the header in its
    /// sector (`BLOCK_FLAG_LAYER_CRCS`).
    pub layer_crcs_crc: u32,
    /// Zero.
    pub reserved: [u8; 16],
    /// crc32c of every byte before it.
    pub header_crc: u32,
}

const _: () = {
    assert!(size_of::<Superblock>() == 512);
    assert!(offset_of!(Superblock, pool_uuid) == 16);
    assert!(offset_of!(Superblock, device_size) == 40);
    assert!(offset_of!(Superblock, object_bytes) == 88);
    assert!(offset_of!(Superblock, namespace) == 104);
    assert!(offset_of!(Superblock, model) == 240);
    assert!(offset_of!(Superblock, created_unix) == 304);
    assert!(offset_of!(Superblock, copies) == 312);
    assert!(offset_of!(Superblock, crc) == 508);
    assert!(size_of::<BlockHeader>() == 128);
    assert!(offset_of!(BlockHeader, slot) == 24);
    assert!(offset_of!(BlockHeader, key) == 40);
    assert!(offset_of!(BlockHeader, namespace_hash) == 80);
    assert!(offset_of!(BlockHeader, data_crc) == 96);
    assert!(offset_of!(BlockHeader, layer_crcs_crc) == 104);
    assert!(LAYER_CRCS_OFFSET >= size_of::<BlockHeader>());
    assert!(BAD_TABLE_OFFSET + BAD_TABLE_BYTES as u64 <= DATA_OFFSET);
    assert!(SUPERBLOCK_OFFSETS[1] >= crate::host::signature::SIGNATURE_PROBE_BYTES as u64);
    assert!(SUPERBLOCK_OFFSETS[1] + 4096 <= BAD_TABLE_OFFSET);
    assert!(SUPERBLOCK_OFFSETS[2] >= BAD_TABLE_OFFSET + BAD_TABLE_BYTES as u64);
    assert!(SUPERBLOCK_OFFSETS[2] + 4096 <= DATA_OFFSET);
    assert!(offset_of!(BlockHeader, header_crc) == 124);
};

impl Superblock {
    /// Sets `crc` over the bytes before it.
    pub fn seal(&mut self) {
        let bytes = bytemuck::bytes_of(self);
        self.crc = crc32c::crc32c(&bytes[..offset_of!(Superblock, crc)]);
    }
    /// Whether `crc` matches.
    pub fn crc_ok(&self) -> bool {
        let bytes = bytemuck::bytes_of(self);
        crc32c::crc32c(&bytes[..offset_of!(Superblock, crc)]) == self.crc
    }
    /// The namespace as text.
    pub fn namespace(&self) -> String {
        let n = (self.namespace_len as usize).min(NAMESPACE_MAX);
        String::from_utf8_lossy(&self.namespace[..n]).into_owned()
    }
    /// The model name as text.
    pub fn model(&self) -> String {
        let n = (self.model_len as usize).min(MODEL_NAME_MAX);
        String::from_utf8_lossy(&self.model[..n]).into_owned()
    }
    /// Whether it is a pool superblock whose checksum holds.
    pub fn is_sound(&self) -> bool {
        self.magic == crate::host::signature::POOL_MAGIC && self.crc_ok()
    }
    /// Offsets of the backup copies it says its device keeps.
    pub fn backup_offsets(&self) -> &'static [u64] {
        let n = (self.copies as usize).clamp(1, SUPERBLOCK_OFFSETS.len());
        &SUPERBLOCK_OFFSETS[1..n]
    }
}

impl BlockHeader {
    /// Sets `header_crc` over the bytes before it.
    pub fn seal(&mut self) {
        let bytes = bytemuck::bytes_of(self);
        self.header_crc = crc32c::crc32c(&bytes[..offset_of!(BlockHeader, header_crc)]);
    }
    /// Whether `header_crc` matches.
    pub fn crc_ok(&self) -> bool {
        let bytes = bytemuck::bytes_of(self);
        crc32c::crc32c(&bytes[..offset_of!(BlockHeader, header_crc)]) == self.header_crc
    }
}

/// Where group `g` lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupPlace {
    /// The device.
    pub dev: u16,
    /// Index of the group on its device.
    pub local: u32,
}

/// The address arithmetic of a pool: pure functions of the geometry, G and
/// the per-device group counts.
#[derive(Clone, Debug)]
pub struct PoolLayout {
    /// The KV geometry.
    pub geometry: KvGeometry,
    /// Blocks per extent group.
    pub group_blocks: u32,
    /// Extent groups on each device.
    pub groups_per_device: Vec<u32>,
    placement: Vec<GroupPlace>,
}

impl PoolLayout {
    /// The layout of `groups_per_device` groups of `group_blocks` blocks, dealt round-robin.
    pub fn new(geometry: KvGeometry, group_blocks: u32, groups_per_device: Vec<u32>) -> Self {
        // Deal groups round-robin: round r takes group r of every device that has one.
        let max = groups_per_device.iter().copied().max().unwrap_or(0);
        let mut placement = Vec::new();
        for r in 0..max {
            for (d, &n) in groups_per_device.iter().enumerate() {
                if r < n {
                    placement.push(GroupPlace {
                        dev: d as u16,
                        local: r,
                    });
                }
            }
        }
        PoolLayout {
            geometry,
            group_blocks,
            groups_per_device,
            placement,
        }
    }

    /// Bytes of one extent group: its headers and its G blocks' objects.
    pub fn group_bytes(&self) -> u64 {
        Self::group_bytes_for(&self.geometry, self.group_blocks)
    }

    /// Bytes of one extent group of `group_blocks` blocks of `g` (headers and data).
    pub fn group_bytes_for(g: &KvGeometry, group_blocks: u32) -> u64 {
        group_blocks as u64 * (SLOT_HEADER_BYTES + g.block_bytes())
    }

    /// The smallest device a pool of `group_blocks`-block groups of `g` fits
    /// on: its superblock area and one extent group.
    pub fn min_device_bytes(g: &KvGeometry, group_blocks: u32) -> u64 {
        DATA_OFFSET + Self::group_bytes_for(g, group_blocks)
    }

    /// How many groups fit in a device of `size` bytes.
    pub fn groups_fitting(g: &KvGeometry, group_blocks: u32, size: u64) -> u32 {
        (size.saturating_sub(DATA_OFFSET) / Self::group_bytes_for(g, group_blocks)) as u32
    }

    /// Extent groups of the pool.
    pub fn total_groups(&self) -> u32 {
        self.placement.len() as u32
    }

    /// Slots of the pool.
    pub fn total_slots(&self) -> u64 {
        self.placement.len() as u64 * self.group_blocks as u64
    }

    /// Where `group` lives.
    pub fn group_place(&self, group: u32) -> GroupPlace {
        self.placement[group as usize]
    }

    fn group_base(&self, group: u32) -> (u16, u64) {
        let p = self.placement[group as usize];
        (p.dev, DATA_OFFSET + p.local as u64 * self.group_bytes())
    }

    /// (device, offset) of a slot's header sector.
    pub fn header_offset(&self, slot: u64) -> (u16, u64) {
        let g = self.group_blocks as u64;
        let (dev, base) = self.group_base((slot / g) as u32);
        (dev, base + (slot % g) * SLOT_HEADER_BYTES)
    }

    /// (device, offset) of the headers of a whole group.
    pub fn group_headers(&self, group: u32) -> (u16, u64, u64) {
        let (dev, base) = self.group_base(group);
        (dev, base, self.group_blocks as u64 * SLOT_HEADER_BYTES)
    }

    /// (device, offset) of object (slot, layer, K|V).
    pub fn object_offset(&self, slot: u64, layer: u32, kv: u32) -> (u16, u64) {
        let g = self.group_blocks as u64;
        let (dev, base) = self.group_base((slot / g) as u32);
        let data = base + g * SLOT_HEADER_BYTES;
        let run = (layer as u64 * 2 + kv as u64) * g + slot % g;
        (dev, data + run * self.geometry.object_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::preset;

    #[test]
    fn a_layer_of_consecutive_blocks_is_contiguous() {
        let g = preset("llama3-8b", 16).unwrap();
        let l = PoolLayout::new(g, 64, vec![3, 3]);
        let obj = g.object_bytes();
        for layer in [0, 7, 31] {
            // K run then V run of group 1, slots 64..128: one extent.
            let (d0, first) = l.object_offset(64, layer, 0);
            for s in 64..128u64 {
                for kv in 0..2 {
                    let (d, off) = l.object_offset(s, layer, kv);
                    assert_eq!(d, d0);
                    assert_eq!(off, first + ((kv as u64) * 64 + (s - 64)) * obj);
                }
            }
        }
    }

    #[test]
    fn groups_round_robin_over_devices_and_fit() {
        let g = preset("llama3-8b", 16).unwrap();
        let l = PoolLayout::new(g, 8, vec![2, 3, 1]);
        let devs: Vec<u16> = (0..l.total_groups())
            .map(|x| l.group_place(x).dev)
            .collect();
        assert_eq!(devs, vec![0, 1, 2, 0, 1, 1]);
        assert_eq!(l.total_slots(), 48);
        // Group 3 is device 0's second group, right after its first.
        let (d, off, len) = l.group_headers(3);
        assert_eq!((d, off), (0, DATA_OFFSET + l.group_bytes()));
        assert_eq!(len, 8 * 4096);
        let size = DATA_OFFSET + 5 * l.group_bytes() + 4095;
        assert_eq!(PoolLayout::groups_fitting(&g, 8, size), 5);
        // Every object and header of every slot lies inside its device's groups.
        for s in 0..l.total_slots() {
            let (d, h) = l.header_offset(s);
            let (d2, o) = l.object_offset(s, 31, 1);
            assert_eq!(d, d2);
            let n = l.groups_per_device[d as usize] as u64;
            assert!(h >= DATA_OFFSET && o + g.object_bytes() <= DATA_OFFSET + n * l.group_bytes());
        }
    }

    #[test]
    fn header_seal_detects_damage() {
        let mut h = BlockHeader::zeroed();
        h.magic = BLOCK_HEADER_MAGIC;
        h.generation = 7;
        h.seal();
        assert!(h.crc_ok());
        h.generation = 8;
        assert!(!h.crc_ok());
        let mut sb = Superblock::zeroed();
        sb.layers = 32;
        sb.seal();
        assert!(sb.crc_ok());
        sb.reserved[5] = 1;
        assert!(!sb.crc_ok());
    }
}
