//! Identify Controller and Identify Namespace data structures.

use super::*;

/// Byte offsets in the Identify Controller data structure.
pub mod idctl {
    /// PCI Vendor ID (u16).
    pub const VID: usize = 0;
    /// PCI Subsystem Vendor ID (u16).
    pub const SSVID: usize = 2;
    /// Serial Number (ASCII, space padded).
    pub const SN: usize = 4;
    /// Bytes of the serial number.
    pub const SN_LEN: usize = 20;
    /// Model Number (ASCII, space padded).
    pub const MN: usize = 24;
    /// Bytes of the model number.
    pub const MN_LEN: usize = 40;
    /// Firmware Revision (ASCII, space padded).
    pub const FR: usize = 64;
    /// Bytes of the firmware revision.
    pub const FR_LEN: usize = 8;
    /// Maximum Data Transfer Size: `2^MDTS` units of CAP.MPSMIN; 0 = no limit.
    pub const MDTS: usize = 77;
    /// Controller ID (u16).
    pub const CNTLID: usize = 78;
    /// Version (u32, the VS register's format).
    pub const VER: usize = 80;
    /// Optional Admin Command Support (u16).
    pub const OACS: usize = 256;
    /// SQ / CQ entry sizes: required (bits 3:0) and maximum (7:4), log2 bytes.
    pub const SQES: usize = 512;
    /// Offset of CQES.
    pub const CQES: usize = 513;
    /// Maximum Outstanding Commands (u16; 0 = not reported).
    pub const MAXCMD: usize = 514;
    /// Number of Namespaces: the largest valid NSID (u32).
    pub const NN: usize = 516;
    /// Optional NVM Command Support (u16).
    pub const ONCS: usize = 520;
    /// Volatile Write Cache (bit 0: present).
    pub const VWC: usize = 525;
    /// SGL Support (u32).
    pub const SGLS: usize = 536;
}

/// Byte offsets in the Identify Namespace data structure.
pub mod idns {
    /// Namespace Size, in logical blocks (u64).
    pub const NSZE: usize = 0;
    /// Namespace Capacity, in logical blocks (u64).
    pub const NCAP: usize = 8;
    /// Namespace Utilization, in logical blocks (u64).
    pub const NUSE: usize = 16;
    /// Offset of NSFEAT.
    pub const NSFEAT: usize = 24;
    /// Number of LBA Formats, 0-based.
    pub const NLBAF: usize = 25;
    /// Formatted LBA Size: format index bits 3:0 (+ bits 6:5 as index
    /// bits 5:4 when more than 16 formats), bit 4 metadata at end of LBA.
    pub const FLBAS: usize = 26;
    /// LBA Format table: `LBAF_LEN`-byte entries (MS bits 15:0, LBADS
    /// bits 23:16 as log2 bytes, RP bits 25:24).
    pub const LBAF: usize = 128;
    /// Bytes of one LBA format.
    pub const LBAF_LEN: usize = 4;
    /// Entries the Identify Namespace structure has room for.
    pub const LBAF_MAX: usize = 64;
}

/// SGLS bits (Identify Controller).
pub mod sgls {
    /// Bits 1:0: 00 no SGLs, 01 SGLs with no alignment rule, 10 SGLs whose
    /// Data Blocks must be dword aligned, 11 reserved.
    pub const SUPPORT_MASK: u32 = 0x3;
    /// SGLs supported, data blocks dword aligned.
    pub const SUPPORT_DWORD_ALIGNED: u32 = 0x2;
    /// Keyed SGL data blocks supported.
    pub const KEYED: u32 = 1 << 2;
    /// Bit bucket descriptors supported.
    pub const BIT_BUCKET: u32 = 1 << 16;
    /// Byte-aligned contiguous metadata pointers supported.
    pub const BYTE_ALIGNED_MPTR: u32 = 1 << 17;
    /// An SGL longer than the transfer is allowed (excess ignored).
    pub const LONGER_THAN_DATA: u32 = 1 << 18;
    /// Metadata pointers may be SGLs.
    pub const MPTR_SGL: u32 = 1 << 19;
    /// Address fields of data blocks may be offsets.
    pub const ADDRESS_OFFSET: u32 = 1 << 20;
}

fn le_u16(d: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([d[off], d[off + 1]])
}

fn le_u32(d: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(d[off..off + 4].try_into().expect("4 bytes"))
}

fn le_u64(d: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(d[off..off + 8].try_into().expect("8 bytes"))
}

fn ascii(d: &[u8]) -> String {
    String::from_utf8_lossy(d)
        .trim_end_matches([' ', '\0'])
        .to_string()
}

/// The Identify Controller fields kvtier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifyController {
    /// PCI vendor id.
    pub vid: u16,
    /// PCI subsystem vendor id.
    pub ssvid: u16,
    /// Serial number.
    pub serial: String,
    /// Model number.
    pub model: String,
    /// Firmware revision.
    pub firmware: String,
    /// Raw MDTS (see [`IdentifyController::max_transfer_bytes`]).
    pub mdts: u8,
    /// Controller id.
    pub cntlid: u16,
    /// NVMe version it reports.
    pub ver: Vs,
    /// Optional admin command support.
    pub oacs: u16,
    /// SQ entry size (required and maximum, log2).
    pub sqes: u8,
    /// CQ entry size (required and maximum, log2).
    pub cqes: u8,
    /// Most commands outstanding (0: not reported).
    pub maxcmd: u16,
    /// Number of namespaces (largest NSID).
    pub nn: u32,
    /// Optional NVM command support.
    pub oncs: u16,
    /// Volatile write cache present.
    pub vwc: u8,
    /// SGL Support; see [`sgls`].
    pub sgls: u32,
}

impl IdentifyController {
    /// Decodes the 4096 bytes of Identify Controller.
    pub fn parse(data: &[u8; IDENTIFY_DATA_LEN]) -> IdentifyController {
        IdentifyController {
            vid: le_u16(data, idctl::VID),
            ssvid: le_u16(data, idctl::SSVID),
            serial: ascii(&data[idctl::SN..idctl::SN + idctl::SN_LEN]),
            model: ascii(&data[idctl::MN..idctl::MN + idctl::MN_LEN]),
            firmware: ascii(&data[idctl::FR..idctl::FR + idctl::FR_LEN]),
            mdts: data[idctl::MDTS],
            cntlid: le_u16(data, idctl::CNTLID),
            ver: Vs(le_u32(data, idctl::VER)),
            oacs: le_u16(data, idctl::OACS),
            sqes: data[idctl::SQES],
            cqes: data[idctl::CQES],
            maxcmd: le_u16(data, idctl::MAXCMD),
            nn: le_u32(data, idctl::NN),
            oncs: le_u16(data, idctl::ONCS),
            vwc: data[idctl::VWC],
            sgls: le_u32(data, idctl::SGLS),
        }
    }

    /// SGLs are supported for NVM I/O commands (SGLS bits 1:0 are 01b or 10b).
    pub const fn sgl_supported(&self) -> bool {
        matches!(self.sgls & sgls::SUPPORT_MASK, 0b01 | 0b10)
    }

    /// SGL Data Blocks must be dword aligned (address and length).
    pub const fn sgl_dword_aligned(&self) -> bool {
        self.sgls & sgls::SUPPORT_MASK == sgls::SUPPORT_DWORD_ALIGNED
    }

    /// Bit bucket descriptors supported.
    pub const fn sgl_bit_bucket(&self) -> bool {
        self.sgls & sgls::BIT_BUCKET != 0
    }

    /// Largest transfer of one command in bytes: `mpsmin_bytes << MDTS`
    /// (MDTS counts in units of CAP.MPSMIN, not of CC.MPS); `None` when the
    /// controller reports no limit (MDTS = 0).
    pub const fn max_transfer_bytes(&self, mpsmin_bytes: u64) -> Option<u64> {
        if self.mdts == 0 {
            None
        } else {
            Some(mpsmin_bytes << self.mdts)
        }
    }

    /// The controller has a volatile write cache (Flush is needed for durability).
    pub const fn volatile_write_cache(&self) -> bool {
        self.vwc & 1 != 0
    }

    /// Required SQ entry size in bytes (SQES bits 3:0 as log2).
    pub const fn sqe_bytes(&self) -> u32 {
        1 << (self.sqes & 0xf)
    }

    /// Required CQ entry size in bytes (CQES bits 3:0 as log2).
    pub const fn cqe_bytes(&self) -> u32 {
        1 << (self.cqes & 0xf)
    }
}

/// One LBA Format entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaFormat {
    /// Metadata bytes per LBA.
    pub ms: u16,
    /// log2 of the LBA data size (0 = format not available).
    pub lbads: u8,
    /// Relative Performance (0 best .. 3 degraded).
    pub rp: u8,
}

impl LbaFormat {
    /// Decodes one LBA format dword.
    pub const fn from_u32(v: u32) -> LbaFormat {
        LbaFormat {
            ms: v as u16,
            lbads: (v >> 16) as u8,
            rp: ((v >> 24) & 0x3) as u8,
        }
    }
}

/// Why Identify data cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentifyError {
    /// FLBAS names a format past those reported.
    #[error("Identify Namespace: formatted LBA format {index} is past the {count} format(s) reported (NLBAF)")]
    FormatIndex {
        /// The format index FLBAS names.
        index: usize,
        /// Formats reported.
        count: usize,
    },
    /// The format's LBA size is one kvtier cannot use.
    #[error("Identify Namespace: LBA format {index} has LBADS {lbads} (LBAs of 2^{lbads} bytes); 9..=16 (512 B to 64 KiB) is expected")]
    LbaSize {
        /// The format.
        index: usize,
        /// Its LBA data size (log2).
        lbads: u8,
    },
}

/// The Identify Namespace fields kvtier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// Size in logical blocks (0 for an inactive NSID).
    pub nsze: u64,
    /// Namespace capacity in LBAs.
    pub ncap: u64,
    /// Namespace utilization in LBAs.
    pub nuse: u64,
    /// LBA formats reported (1-based: NLBAF + 1).
    pub lba_format_count: usize,
    /// The formatted LBA format's index into the table.
    pub lba_format_index: usize,
    /// Bytes of data per logical block of the formatted format.
    pub lba_bytes: u32,
    /// Metadata bytes per logical block of the formatted format.
    pub metadata_bytes: u16,
    /// Metadata is transferred at the end of each LBA (FLBAS bit 4).
    pub extended_lba: bool,
    /// The LBA formats it supports.
    pub lba_formats: Vec<LbaFormat>,
}

impl IdentifyNamespace {
    /// Decodes the 4096 bytes of Identify Namespace.
    pub fn parse(data: &[u8; IDENTIFY_DATA_LEN]) -> Result<IdentifyNamespace, IdentifyError> {
        let count = (data[idns::NLBAF] as usize + 1).min(idns::LBAF_MAX);
        let flbas = data[idns::FLBAS];
        let mut index = (flbas & 0xf) as usize;
        if count > 16 {
            index |= (((flbas >> 5) & 0x3) as usize) << 4;
        }
        if index >= count {
            return Err(IdentifyError::FormatIndex { index, count });
        }
        let lba_formats: Vec<LbaFormat> = (0..count)
            .map(|i| LbaFormat::from_u32(le_u32(data, idns::LBAF + i * idns::LBAF_LEN)))
            .collect();
        let format = lba_formats[index];
        if !(9..=16).contains(&format.lbads) {
            return Err(IdentifyError::LbaSize {
                index,
                lbads: format.lbads,
            });
        }
        Ok(IdentifyNamespace {
            nsze: le_u64(data, idns::NSZE),
            ncap: le_u64(data, idns::NCAP),
            nuse: le_u64(data, idns::NUSE),
            lba_format_count: count,
            lba_format_index: index,
            lba_bytes: 1 << format.lbads,
            metadata_bytes: format.ms,
            extended_lba: flbas & 0x10 != 0,
            lba_formats,
        })
    }

    /// Namespace size in bytes.
    pub const fn size_bytes(&self) -> u64 {
        self.nsze * self.lba_bytes as u64
    }
}
