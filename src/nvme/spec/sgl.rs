//! SGL descriptor types and the descriptors kvtier builds (Data Block, Segment, Last Segment).

use super::*;

/// SGL descriptor types (identifier byte, high nibble).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SglType {
    /// One memory extent.
    DataBlock = 0x0,
    /// Discard (reads) / ignore (writes); QEMU 7.2 does not support it (0x400d).
    BitBucket = 0x1,
    /// Points at the next segment of descriptors; more segments follow it.
    Segment = 0x2,
    /// Points at the last segment of descriptors (data blocks only).
    LastSegment = 0x3,
    /// Keyed SGL data block.
    KeyedDataBlock = 0x4,
    /// Transport SGL data block.
    TransportDataBlock = 0x5,
    /// Vendor specific.
    VendorSpecific = 0xf,
}

impl SglType {
    /// The type of a descriptor's high nibble, if defined.
    pub const fn from_nibble(nibble: u8) -> Option<SglType> {
        Some(match nibble {
            0x0 => SglType::DataBlock,
            0x1 => SglType::BitBucket,
            0x2 => SglType::Segment,
            0x3 => SglType::LastSegment,
            0x4 => SglType::KeyedDataBlock,
            0x5 => SglType::TransportDataBlock,
            0xf => SglType::VendorSpecific,
            _ => return None,
        })
    }
}

/// SGL descriptor subtype "Address" (identifier byte, low nibble): the
/// descriptor's address is a memory address. kvtier uses no other.
pub const SGL_SUBTYPE_ADDRESS: u8 = 0x0;

/// Identifier bytes (type << 4 | subtype) of the descriptors kvtier builds.
/// Data Block (0h) with subtype Address (0h): the descriptor of one memory extent.
pub const SGL_ID_DATA_BLOCK: u8 = (SglType::DataBlock as u8) << 4 | SGL_SUBTYPE_ADDRESS;
/// Identifier byte of a bit bucket descriptor.
pub const SGL_ID_BIT_BUCKET: u8 = (SglType::BitBucket as u8) << 4;
/// Identifier byte of a segment descriptor.
pub const SGL_ID_SEGMENT: u8 = (SglType::Segment as u8) << 4;
/// Identifier byte of a last segment descriptor.
pub const SGL_ID_LAST_SEGMENT: u8 = (SglType::LastSegment as u8) << 4;

/// Bytes of one SGL descriptor; a segment's length is a multiple of it.
pub const SGL_DESCRIPTOR_LEN: u32 = 16;

/// The spec's SGL descriptor kinds, on the gio_uring ABI's 16-byte
/// descriptor (the P2P table's Data Block type). A segment descriptor's `len`
/// is the byte length of the segment it points at: 16 × its descriptors.
impl SglDescriptor {
    /// Points at a segment of `descriptors` descriptors at `addr`, the last of
    /// which is itself a Segment or Last Segment descriptor.
    pub const fn segment(addr: u64, descriptors: u32) -> SglDescriptor {
        SglDescriptor {
            addr,
            len: descriptors * SGL_DESCRIPTOR_LEN,
            reserved: [0; 3],
            sgl_id: SGL_ID_SEGMENT,
        }
    }

    /// Points at the final segment: `descriptors` Data Block descriptors at `addr`.
    pub const fn last_segment(addr: u64, descriptors: u32) -> SglDescriptor {
        SglDescriptor {
            addr,
            len: descriptors * SGL_DESCRIPTOR_LEN,
            reserved: [0; 3],
            sgl_id: SGL_ID_LAST_SEGMENT,
        }
    }

    /// `len` bytes the controller discards (reads) or ignores (writes); only
    /// valid when Identify's SGLS says bit buckets are supported.
    pub const fn bit_bucket(len: u32) -> SglDescriptor {
        SglDescriptor {
            addr: 0,
            len,
            reserved: [0; 3],
            sgl_id: SGL_ID_BIT_BUCKET,
        }
    }

    /// The descriptor type (identifier high nibble); `None` for reserved types.
    pub const fn sgl_type(&self) -> Option<SglType> {
        SglType::from_nibble(self.sgl_id >> 4)
    }

    /// The descriptor subtype (identifier low nibble).
    pub const fn sgl_subtype(&self) -> u8 {
        self.sgl_id & 0x0f
    }
}
