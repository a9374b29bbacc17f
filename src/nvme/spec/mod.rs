//! NVMe specification layouts: commands, completions, SGL and PRP data
//! pointers, controller registers, Identify data and status codes.
//!
//! Everything here is a byte layout defined by the NVM Express Base
//! Specification (PCIe transport) and the NVM Command Set Specification; the
//! numbers are the spec's, and every struct carries size and offset asserts.
//! The C/CUDA twin is `kernels/nvme_spec.h` (the GPU engine builds SQEs from
//! the same layouts); `tests/nvme_header.rs` compiles it with `static_assert`s
//! generated from [`nvme_constants`] and [`nvme_layouts`] so the two sides
//! cannot drift.
//!
//! Rooms: commands, completions and data pointers here; [`status`](Status) codes;
//! SGL descriptors (`sgl`); PRP building (`prp`, apart from the layouts it fills);
//! controller registers (`regs`); Identify data (`identify`); the layout asserts and the
//! C twin's numbers (`twin`). Everything is re-exported here, so callers name
//! `nvme::spec::X` whichever room holds it.
//!
//! Nothing in this module touches hardware: it is pure data and encoding, so it
//! is used alike by the CPU queue pairs, the simulated controller of the tests,
//! and host code that prepares descriptors for GPU kernels.
//!
//! All multi-byte fields are little-endian on the wire; the structs are read
//! and written with native loads and stores, so the crate refuses to build on
//! a big-endian target rather than send byte-swapped commands to a device.

use bytemuck::{Pod, Zeroable};

/// A 16-byte NVMe SGL Data Block descriptor (NVMe base spec, "SGL Data Block
/// descriptor"): one contiguous memory extent. The P2P table is an array of
/// these (re-exported by the gio_uring ABI, [`crate::ring::abi`]), so a GPU kernel
/// copies entries straight into an SGL segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct SglDescriptor {
    /// Memory address the device DMAs to/from (host virtual for the io_uring
    /// engine, IOVA for VFIO, GPU physical/BAR address for the GPU engine).
    pub addr: u64,
    /// Extent length in bytes.
    pub len: u32,
    /// Zero.
    pub reserved: [u8; 3],
    /// SGL identifier: descriptor type (high nibble) and subtype (low nibble).
    pub sgl_id: u8,
}

impl SglDescriptor {
    /// A data block descriptor of `len` bytes at `addr`.
    pub fn data_block(addr: u64, len: u32) -> Self {
        SglDescriptor {
            addr,
            len,
            reserved: [0; 3],
            sgl_id: SGL_ID_DATA_BLOCK,
        }
    }
}

#[cfg(target_endian = "big")]
compile_error!("kvtier's NVMe layouts assume a little-endian host (NVMe is little-endian)");

// ------------------------------------------------------------------ opcodes --

/// Admin command set opcodes (submitted on queue 0).
pub mod admin_opc {
    /// Delete I/O submission queue.
    pub const DELETE_IO_SQ: u8 = 0x00;
    /// Create I/O submission queue.
    pub const CREATE_IO_SQ: u8 = 0x01;
    /// Get log page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Delete I/O completion queue.
    pub const DELETE_IO_CQ: u8 = 0x04;
    /// Create I/O completion queue.
    pub const CREATE_IO_CQ: u8 = 0x05;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get features.
    pub const GET_FEATURES: u8 = 0x0a;
}

/// NVM command set opcodes (I/O queues). The gio_uring IOCTX opcodes are the
/// same numbers (asserted in `crate::ring::abi`), so an engine copies `IoCtx::op` unchanged.
pub mod nvm_opc {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
}

/// Identify CNS values (CDW10 bits 7:0).
pub mod cns {
    /// Identify Namespace data structure for the NSID in the command.
    pub const NAMESPACE: u8 = 0x00;
    /// Identify Controller data structure.
    pub const CONTROLLER: u8 = 0x01;
    /// Active namespace ID list (NSIDs greater than the command's NSID).
    pub const ACTIVE_NAMESPACES: u8 = 0x02;
}

/// Feature identifiers for Set/Get Features (CDW10 bits 7:0).
pub mod feature {
    /// Number of Queues: CDW11 = NCQR << 16 | NSQR (both 0-based); the
    /// completion's DW0 holds the allocated numbers in the same format.
    pub const NUMBER_OF_QUEUES: u8 = 0x07;
}

/// Bytes of every Identify data structure.
pub const IDENTIFY_DATA_LEN: usize = 4096;

// ---------------------------------------------------------------- SQE flags --

/// CDW0 byte 1 holds FUSE (bits 1:0) and PSDT (bits 7:6).
pub const SQE_FLAGS_FUSE_MASK: u8 = 0x03;
/// Shift of PSDT in the SQE flags.
pub const SQE_FLAGS_PSDT_SHIFT: u8 = 6;
/// PSDT bits of the SQE flags.
pub const SQE_FLAGS_PSDT_MASK: u8 = 0x03 << SQE_FLAGS_PSDT_SHIFT;

/// Fused operation (CDW0 bits 9:8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Fuse {
    /// Not fused.
    Normal = 0b00,
    /// First command of a fused pair.
    First = 0b01,
    /// Second command of a fused pair.
    Second = 0b10,
    /// Reserved.
    Reserved = 0b11,
}

impl Fuse {
    /// The FUSE of these 2 bits.
    pub const fn from_bits(bits: u8) -> Fuse {
        match bits & SQE_FLAGS_FUSE_MASK {
            0b00 => Fuse::Normal,
            0b01 => Fuse::First,
            0b10 => Fuse::Second,
            _ => Fuse::Reserved,
        }
    }
}

/// PRP or SGL for Data Transfer (CDW0 bits 15:14).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Psdt {
    /// PRPs describe the data (the only choice for admin commands on PCIe).
    Prp = 0b00,
    /// SGL for data; MPTR is the address of one contiguous metadata buffer.
    SglMptrContiguous = 0b01,
    /// SGL for data; MPTR is the address of an SGL segment for metadata.
    SglMptrSgl = 0b10,
    /// Reserved: QEMU answers Invalid Field in Command (0x4002).
    Reserved = 0b11,
}

impl Psdt {
    /// The PSDT of these 2 bits.
    pub const fn from_bits(bits: u8) -> Psdt {
        match bits & 0b11 {
            0b00 => Psdt::Prp,
            0b01 => Psdt::SglMptrContiguous,
            0b10 => Psdt::SglMptrSgl,
            _ => Psdt::Reserved,
        }
    }
}

// ---------------------------------------------------------- data pointers --

/// Data Pointer (DPTR, SQE bytes 24..40): PRP Entry 1 and PRP Entry 2, or SGL
/// Descriptor 1 in the same 16 bytes (`addr` = `prp1`; `len`, reserved and
/// identifier in `prp2`). The C twin is the union `kvtier_nvme_dptr`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Dptr {
    /// PRP entry 1, or the SGL descriptor's first 8 bytes.
    pub prp1: u64,
    /// PRP entry 2, or the SGL descriptor's last 8 bytes.
    pub prp2: u64,
}

impl Dptr {
    /// The 16 bytes read as SGL Descriptor 1.
    pub fn sgl1(self) -> SglDescriptor {
        bytemuck::cast(self)
    }

    /// SGL Descriptor 1 as the 16 bytes of DPTR.
    pub fn from_sgl(desc: SglDescriptor) -> Dptr {
        bytemuck::cast(desc)
    }
}

/// How a command's data is described: the DPTR contents and, implied by the
/// variant, the PSDT bits ([`Sqe::set_data_ptr`] sets both).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataPtr {
    /// PSDT 00b. `prp2` is 0, the second page, or the address of a PRP list
    /// (see [`build_prps`]).
    Prp {
        /// PRP entry 1.
        prp1: u64,
        /// PRP entry 2.
        prp2: u64,
    },
    /// PSDT 01b: SGL Descriptor 1, a Data Block (the whole transfer is one
    /// extent), a Segment or a Last Segment pointing at more descriptors.
    Sgl(SglDescriptor),
}

impl DataPtr {
    /// The PSDT this pointer needs.
    pub const fn psdt(&self) -> Psdt {
        match self {
            DataPtr::Prp { .. } => Psdt::Prp,
            DataPtr::Sgl(_) => Psdt::SglMptrContiguous,
        }
    }

    /// As the SQE's DPTR field.
    pub fn dptr(&self) -> Dptr {
        match *self {
            DataPtr::Prp { prp1, prp2 } => Dptr { prp1, prp2 },
            DataPtr::Sgl(desc) => Dptr::from_sgl(desc),
        }
    }
}

// ---------------------------------------------------------------------- SQE --

/// A 64-byte Submission Queue Entry (NVMe base spec, "Common Command Format").
///
/// Fields are public because this is a wire layout; the constructors below
/// fill the command-specific dwords for the commands kvtier issues, and
/// [`crate::nvme::queue::QueuePair::submit`] overwrites `cid`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Sqe {
    /// CDW0 bits 7:0.
    pub opcode: u8,
    /// CDW0 bits 15:8: FUSE (bits 1:0 of this byte) and PSDT (bits 7:6).
    pub flags: u8,
    /// CDW0 bits 31:16: command identifier, unique among the commands
    /// outstanding on one submission queue.
    pub cid: u16,
    /// Namespace ID (1-based; 0 when unused, 0xffffffff for all namespaces).
    pub nsid: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// Metadata pointer (unused by kvtier: namespaces have no metadata).
    pub mptr: u64,
    /// Data pointer.
    pub dptr: Dptr,
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

impl Sqe {
    /// A zeroed command with `opcode` and `cid`.
    pub const fn new(opcode: u8, cid: u16) -> Sqe {
        Sqe {
            opcode,
            flags: 0,
            cid,
            nsid: 0,
            cdw2: 0,
            cdw3: 0,
            mptr: 0,
            dptr: Dptr { prp1: 0, prp2: 0 },
            cdw10: 0,
            cdw11: 0,
            cdw12: 0,
            cdw13: 0,
            cdw14: 0,
            cdw15: 0,
        }
    }

    fn rw(opcode: u8, cid: u16, nsid: u32, slba: u64, nlb_zero_based: u16, data: DataPtr) -> Sqe {
        let mut sqe = Sqe::new(opcode, cid);
        sqe.nsid = nsid;
        sqe.cdw10 = slba as u32;
        sqe.cdw11 = (slba >> 32) as u32;
        sqe.cdw12 = nlb_zero_based as u32;
        sqe.set_data_ptr(data);
        sqe
    }

    /// NVM Read of `nlb_zero_based + 1` logical blocks starting at `slba`.
    pub fn read(cid: u16, nsid: u32, slba: u64, nlb_zero_based: u16, data: DataPtr) -> Sqe {
        Sqe::rw(nvm_opc::READ, cid, nsid, slba, nlb_zero_based, data)
    }

    /// NVM Write of `nlb_zero_based + 1` logical blocks starting at `slba`.
    pub fn write(cid: u16, nsid: u32, slba: u64, nlb_zero_based: u16, data: DataPtr) -> Sqe {
        Sqe::rw(nvm_opc::WRITE, cid, nsid, slba, nlb_zero_based, data)
    }

    /// NVM Flush: everything written to `nsid` before it is durable after it
    /// completes.
    pub fn flush(cid: u16, nsid: u32) -> Sqe {
        let mut sqe = Sqe::new(nvm_opc::FLUSH, cid);
        sqe.nsid = nsid;
        sqe
    }

    /// Identify (`cns` from [`cns`]) into the 4096-byte buffer at `prp1`,
    /// which must not cross a memory page (a page-aligned buffer with a page
    /// size of at least 4 KiB), so one PRP entry describes it.
    pub fn identify(cid: u16, cns: u8, nsid: u32, prp1: u64) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::IDENTIFY, cid);
        sqe.nsid = nsid;
        sqe.dptr = Dptr { prp1, prp2: 0 };
        sqe.cdw10 = cns as u32;
        sqe
    }

    /// Create I/O Completion Queue `qid` of `entries` entries, physically
    /// contiguous at `prp1` (page-aligned). `irq` is the interrupt vector to
    /// enable, or `None` for a polled queue.
    pub fn create_io_cq(cid: u16, qid: u16, entries: u16, prp1: u64, irq: Option<u16>) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::CREATE_IO_CQ, cid);
        sqe.dptr = Dptr { prp1, prp2: 0 };
        sqe.cdw10 = ((entries.saturating_sub(1) as u32) << 16) | qid as u32;
        // CDW11: IV (31:16), IEN (1), PC (0).
        sqe.cdw11 = match irq {
            Some(vector) => ((vector as u32) << 16) | 0b11,
            None => 0b01,
        };
        sqe
    }

    /// Create I/O Submission Queue `qid` of `entries` entries, physically
    /// contiguous at `prp1` (page-aligned), completing into `cqid`, with
    /// medium priority (ignored under round-robin arbitration).
    pub fn create_io_sq(cid: u16, qid: u16, entries: u16, prp1: u64, cqid: u16) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::CREATE_IO_SQ, cid);
        sqe.dptr = Dptr { prp1, prp2: 0 };
        sqe.cdw10 = ((entries.saturating_sub(1) as u32) << 16) | qid as u32;
        // CDW11: CQID (31:16), QPRIO (2:1), PC (0).
        sqe.cdw11 = ((cqid as u32) << 16) | (0b10 << 1) | 0b1;
        sqe
    }

    /// Delete I/O Submission Queue `qid` (before its completion queue).
    pub fn delete_io_sq(cid: u16, qid: u16) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::DELETE_IO_SQ, cid);
        sqe.cdw10 = qid as u32;
        sqe
    }

    /// Delete I/O Completion Queue `qid` (after every SQ using it).
    pub fn delete_io_cq(cid: u16, qid: u16) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::DELETE_IO_CQ, cid);
        sqe.cdw10 = qid as u32;
        sqe
    }

    /// Set Features, Number of Queues: ask for `sqs` I/O submission and
    /// `cqs` I/O completion queues (each at least 1). The controller's answer
    /// is in the completion's DW0; decode it with [`allocated_queues`].
    pub fn set_features_num_queues(cid: u16, sqs: u16, cqs: u16) -> Sqe {
        let mut sqe = Sqe::new(admin_opc::SET_FEATURES, cid);
        sqe.cdw10 = feature::NUMBER_OF_QUEUES as u32;
        sqe.cdw11 = ((cqs.saturating_sub(1) as u32) << 16) | sqs.saturating_sub(1) as u32;
        sqe
    }

    /// The FUSE field.
    pub const fn fuse(&self) -> Fuse {
        Fuse::from_bits(self.flags)
    }

    /// Sets the FUSE field.
    pub fn set_fuse(&mut self, fuse: Fuse) {
        self.flags = (self.flags & !SQE_FLAGS_FUSE_MASK) | fuse as u8;
    }

    /// The PSDT field.
    pub const fn psdt(&self) -> Psdt {
        Psdt::from_bits(self.flags >> SQE_FLAGS_PSDT_SHIFT)
    }

    /// Sets the PSDT bits alone (tests of error paths use `Psdt::Reserved`);
    /// [`Sqe::set_data_ptr`] is the normal way.
    pub fn set_psdt(&mut self, psdt: Psdt) {
        self.flags = (self.flags & !SQE_FLAGS_PSDT_MASK) | ((psdt as u8) << SQE_FLAGS_PSDT_SHIFT);
    }

    /// Writes DPTR and the matching PSDT bits.
    pub fn set_data_ptr(&mut self, data: DataPtr) {
        self.dptr = data.dptr();
        self.set_psdt(data.psdt());
    }

    /// DPTR decoded by the PSDT bits; `None` for the reserved PSDT 11b.
    pub fn data_ptr(&self) -> Option<DataPtr> {
        match self.psdt() {
            Psdt::Prp => Some(DataPtr::Prp {
                prp1: self.dptr.prp1,
                prp2: self.dptr.prp2,
            }),
            Psdt::SglMptrContiguous | Psdt::SglMptrSgl => Some(DataPtr::Sgl(self.dptr.sgl1())),
            Psdt::Reserved => None,
        }
    }

    /// Starting LBA of a Read or Write (CDW11:CDW10).
    pub const fn slba(&self) -> u64 {
        ((self.cdw11 as u64) << 32) | self.cdw10 as u64
    }

    /// Number of logical blocks of a Read or Write, 1-based (CDW12 bits 15:0 + 1).
    pub const fn nlb(&self) -> u32 {
        (self.cdw12 & 0xffff) + 1
    }
}

/// Decodes the DW0 of a completed Set Features (Number of Queues) into the
/// numbers of I/O submission and completion queues allocated (1-based).
pub const fn allocated_queues(dw0: u32) -> (u32, u32) {
    ((dw0 & 0xffff) + 1, (dw0 >> 16) + 1)
}

// ---------------------------------------------------------------------- CQE --

/// Bit 0 of the CQE status field: the phase tag.
pub const CQE_STATUS_PHASE: u16 = 0x0001;

/// A 16-byte Completion Queue Entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Pod, Zeroable)]
pub struct Cqe {
    /// Command specific (e.g. Set Features' allocated queue counts).
    pub dw0: u32,
    /// Dword 1 (command specific).
    pub dw1: u32,
    /// The controller's SQ head pointer when it posted this entry: every SQ
    /// slot before it has been fetched and may be reused.
    pub sq_head: u16,
    /// The submission queue the command came from.
    pub sq_id: u16,
    /// The command id.
    pub cid: u16,
    /// The raw status field: bit 0 phase tag, bits 8:1 SC, 11:9 SCT, 13:12
    /// CRD, 14 More, 15 DNR. [`Cqe::status`] shifts the phase tag out.
    pub status: u16,
}

impl Cqe {
    /// The phase tag.
    pub const fn phase(&self) -> bool {
        self.status & CQE_STATUS_PHASE != 0
    }

    /// The status with the phase tag shifted out (see [`Status`]).
    pub const fn status(&self) -> Status {
        Status::from_cqe_field(self.status)
    }

    /// The raw status field for a CQE with `status` and `phase`: what a
    /// controller (or the simulated one) writes.
    pub const fn status_field(status: Status, phase: bool) -> u16 {
        (status.raw() << 1) | phase as u16
    }
}

mod identify;
mod prp;
mod regs;
mod sgl;
mod status;
mod twin;

pub use identify::*;
pub use prp::*;
pub use regs::*;
pub use sgl::*;
pub use status::*;
pub use twin::*;

#[cfg(test)]
mod tests;
