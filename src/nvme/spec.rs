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
//! Nothing in this module touches hardware: it is pure data and encoding, so it
//! is used alike by the CPU queue pairs, the simulated controller of the tests,
//! and host code that prepares descriptors for GPU kernels.
//!
//! All multi-byte fields are little-endian on the wire; the structs are read
//! and written with native loads and stores, so the crate refuses to build on
//! a big-endian target rather than send byte-swapped commands to a device.

use bytemuck::{Pod, Zeroable};
use std::fmt;
use std::mem::{offset_of, size_of};

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
    pub reserved: [u8; 3],
    /// SGL identifier: descriptor type (high nibble) and subtype (low nibble).
    pub sgl_id: u8,
}

impl SglDescriptor {
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
    pub const DELETE_IO_SQ: u8 = 0x00;
    pub const CREATE_IO_SQ: u8 = 0x01;
    pub const GET_LOG_PAGE: u8 = 0x02;
    pub const DELETE_IO_CQ: u8 = 0x04;
    pub const CREATE_IO_CQ: u8 = 0x05;
    pub const IDENTIFY: u8 = 0x06;
    pub const ABORT: u8 = 0x08;
    pub const SET_FEATURES: u8 = 0x09;
    pub const GET_FEATURES: u8 = 0x0a;
}

/// NVM command set opcodes (I/O queues). The gio_uring IOCTX opcodes are the
/// same numbers (asserted in `crate::ring::abi`), so an engine copies `IoCtx::op` unchanged.
pub mod nvm_opc {
    pub const FLUSH: u8 = 0x00;
    pub const WRITE: u8 = 0x01;
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
pub const SQE_FLAGS_PSDT_SHIFT: u8 = 6;
pub const SQE_FLAGS_PSDT_MASK: u8 = 0x03 << SQE_FLAGS_PSDT_SHIFT;

/// Fused operation (CDW0 bits 9:8).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Fuse {
    Normal = 0b00,
    First = 0b01,
    Second = 0b10,
    Reserved = 0b11,
}

impl Fuse {
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
    pub prp1: u64,
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
    Prp { prp1: u64, prp2: u64 },
    /// PSDT 01b: SGL Descriptor 1, a Data Block (the whole transfer is one
    /// extent), a Segment or a Last Segment pointing at more descriptors.
    Sgl(SglDescriptor),
}

impl DataPtr {
    pub const fn psdt(&self) -> Psdt {
        match self {
            DataPtr::Prp { .. } => Psdt::Prp,
            DataPtr::Sgl(_) => Psdt::SglMptrContiguous,
        }
    }

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
    pub cdw2: u32,
    pub cdw3: u32,
    /// Metadata pointer (unused by kvtier: namespaces have no metadata).
    pub mptr: u64,
    pub dptr: Dptr,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
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

    pub const fn fuse(&self) -> Fuse {
        Fuse::from_bits(self.flags)
    }

    pub fn set_fuse(&mut self, fuse: Fuse) {
        self.flags = (self.flags & !SQE_FLAGS_FUSE_MASK) | fuse as u8;
    }

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
    pub dw1: u32,
    /// The controller's SQ head pointer when it posted this entry: every SQ
    /// slot before it has been fetched and may be reused.
    pub sq_head: u16,
    /// The submission queue the command came from.
    pub sq_id: u16,
    pub cid: u16,
    /// The raw status field: bit 0 phase tag, bits 8:1 SC, 11:9 SCT, 13:12
    /// CRD, 14 More, 15 DNR. [`Cqe::status`] shifts the phase tag out.
    pub status: u16,
}

impl Cqe {
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

// ------------------------------------------------------------------- status --

/// Status Code Type (the SCT field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sct {
    Generic,
    CommandSpecific,
    MediaAndDataIntegrity,
    Path,
    VendorSpecific,
    Reserved(u8),
}

impl Sct {
    pub const fn from_bits(bits: u8) -> Sct {
        match bits & 0x7 {
            0 => Sct::Generic,
            1 => Sct::CommandSpecific,
            2 => Sct::MediaAndDataIntegrity,
            3 => Sct::Path,
            7 => Sct::VendorSpecific,
            other => Sct::Reserved(other),
        }
    }

    pub const fn bits(self) -> u8 {
        match self {
            Sct::Generic => 0,
            Sct::CommandSpecific => 1,
            Sct::MediaAndDataIntegrity => 2,
            Sct::Path => 3,
            Sct::VendorSpecific => 7,
            Sct::Reserved(bits) => bits & 0x7,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Sct::Generic => "generic",
            Sct::CommandSpecific => "command specific",
            Sct::MediaAndDataIntegrity => "media and data integrity",
            Sct::Path => "path",
            Sct::VendorSpecific => "vendor specific",
            Sct::Reserved(_) => "reserved type",
        }
    }
}

/// Bit layout of [`Status::raw`] (the CQE status field shifted right by one).
pub const STATUS_SC_MASK: u16 = 0x00ff;
pub const STATUS_SCT_SHIFT: u16 = 8;
pub const STATUS_SCT_MASK: u16 = 0x7 << STATUS_SCT_SHIFT;
pub const STATUS_CRD_SHIFT: u16 = 11;
pub const STATUS_CRD_MASK: u16 = 0x3 << STATUS_CRD_SHIFT;
pub const STATUS_MORE: u16 = 1 << 13;
pub const STATUS_DNR: u16 = 1 << 14;

/// A completion status: the CQE's 16-bit status field shifted right by one,
/// so the phase tag is gone and the value is what QEMU's NVMe model and
/// Linux's nvme driver print. Bits: 7:0 SC, 10:8 SCT, 12:11 CRD, 13 More,
/// 14 Do Not Retry. So `0x400f` is DNR + generic SC 0x0f (Data SGL Length
/// Invalid), QEMU's answer to an SGL shorter than the transfer.
///
/// [`Status::code`] (`SCT << 8 | SC`, no CRD/More/DNR) is the value an NVMe
/// engine stores in `IoCtx::status` (always below 0x0800, as the gio_uring
/// ABI requires). The associated constants are codes with DNR clear; compare
/// a completion against them with [`Status::is`].
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(u16);

impl Status {
    pub const SUCCESS: Status = Status::generic(0x00);
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03);
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    pub const ABORTED_POWER_LOSS: Status = Status::generic(0x05);
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    pub const INVALID_NAMESPACE_OR_FORMAT: Status = Status::generic(0x0b);
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c);
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: Status = Status::generic(0x0d);
    pub const INVALID_NUMBER_OF_SGL_DESCRIPTORS: Status = Status::generic(0x0e);
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0f);
    pub const METADATA_SGL_LENGTH_INVALID: Status = Status::generic(0x10);
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11);
    pub const PRP_OFFSET_INVALID: Status = Status::generic(0x13);
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16);
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81);
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);

    pub const COMPLETION_QUEUE_INVALID: Status = Status::command_specific(0x00);
    pub const INVALID_QUEUE_IDENTIFIER: Status = Status::command_specific(0x01);
    pub const INVALID_QUEUE_SIZE: Status = Status::command_specific(0x02);
    pub const INVALID_INTERRUPT_VECTOR: Status = Status::command_specific(0x08);
    pub const INVALID_QUEUE_DELETION: Status = Status::command_specific(0x0c);

    pub const WRITE_FAULT: Status = Status::media(0x80);
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);

    /// From a value in the [`Status::raw`] encoding (bit 15 is ignored).
    pub const fn from_raw(raw: u16) -> Status {
        Status(raw & 0x7fff)
    }

    /// From the CQE's status field, phase tag in bit 0.
    pub const fn from_cqe_field(field: u16) -> Status {
        Status(field >> 1)
    }

    pub const fn new(sct: Sct, sc: u8) -> Status {
        Status(((sct.bits() as u16) << STATUS_SCT_SHIFT) | sc as u16)
    }

    const fn generic(sc: u8) -> Status {
        Status::new(Sct::Generic, sc)
    }

    const fn command_specific(sc: u8) -> Status {
        Status::new(Sct::CommandSpecific, sc)
    }

    const fn media(sc: u8) -> Status {
        Status::new(Sct::MediaAndDataIntegrity, sc)
    }

    /// The same status with Do Not Retry set.
    pub const fn with_dnr(self) -> Status {
        Status(self.0 | STATUS_DNR)
    }

    /// The 15-bit status as QEMU logs it (e.g. 0x400f), phase tag shifted out.
    pub const fn raw(self) -> u16 {
        self.0
    }

    /// `SCT << 8 | SC`: the status without CRD, More and DNR.
    pub const fn code(self) -> u16 {
        self.0 & (STATUS_SCT_MASK | STATUS_SC_MASK)
    }

    /// Same status code type and code as `other` (CRD, More and DNR ignored).
    pub const fn is(self, other: Status) -> bool {
        self.code() == other.code()
    }

    pub const fn sc(self) -> u8 {
        (self.0 & STATUS_SC_MASK) as u8
    }

    pub const fn sct(self) -> Sct {
        Sct::from_bits(((self.0 & STATUS_SCT_MASK) >> STATUS_SCT_SHIFT) as u8)
    }

    /// Command Retry Delay: index into the controller's CRDT table.
    pub const fn crd(self) -> u8 {
        ((self.0 & STATUS_CRD_MASK) >> STATUS_CRD_SHIFT) as u8
    }

    pub const fn more(self) -> bool {
        self.0 & STATUS_MORE != 0
    }

    pub const fn dnr(self) -> bool {
        self.0 & STATUS_DNR != 0
    }

    pub const fn is_success(self) -> bool {
        self.code() == 0
    }

    /// The spec's name for the codes kvtier meets; `None` for others.
    pub const fn name(self) -> Option<&'static str> {
        let name = match (self.sct(), self.sc()) {
            (Sct::Generic, 0x00) => "Successful Completion",
            (Sct::Generic, 0x01) => "Invalid Command Opcode",
            (Sct::Generic, 0x02) => "Invalid Field in Command",
            (Sct::Generic, 0x03) => "Command ID Conflict",
            (Sct::Generic, 0x04) => "Data Transfer Error",
            (Sct::Generic, 0x05) => "Commands Aborted due to Power Loss Notification",
            (Sct::Generic, 0x06) => "Internal Error",
            (Sct::Generic, 0x07) => "Command Abort Requested",
            (Sct::Generic, 0x08) => "Command Aborted due to SQ Deletion",
            (Sct::Generic, 0x0b) => "Invalid Namespace or Format",
            (Sct::Generic, 0x0c) => "Command Sequence Error",
            (Sct::Generic, 0x0d) => "Invalid SGL Segment Descriptor",
            (Sct::Generic, 0x0e) => "Invalid Number of SGL Descriptors",
            (Sct::Generic, 0x0f) => "Data SGL Length Invalid",
            (Sct::Generic, 0x10) => "Metadata SGL Length Invalid",
            (Sct::Generic, 0x11) => "SGL Descriptor Type Invalid",
            (Sct::Generic, 0x12) => "Invalid Use of Controller Memory Buffer",
            (Sct::Generic, 0x13) => "PRP Offset Invalid",
            (Sct::Generic, 0x15) => "Operation Denied",
            (Sct::Generic, 0x16) => "SGL Offset Invalid",
            (Sct::Generic, 0x80) => "LBA Out of Range",
            (Sct::Generic, 0x81) => "Capacity Exceeded",
            (Sct::Generic, 0x82) => "Namespace Not Ready",
            (Sct::CommandSpecific, 0x00) => "Completion Queue Invalid",
            (Sct::CommandSpecific, 0x01) => "Invalid Queue Identifier",
            (Sct::CommandSpecific, 0x02) => "Invalid Queue Size",
            (Sct::CommandSpecific, 0x03) => "Abort Command Limit Exceeded",
            (Sct::CommandSpecific, 0x08) => "Invalid Interrupt Vector",
            (Sct::CommandSpecific, 0x09) => "Invalid Log Page",
            (Sct::CommandSpecific, 0x0c) => "Invalid Queue Deletion",
            (Sct::CommandSpecific, 0x0d) => "Feature Identifier Not Saveable",
            (Sct::CommandSpecific, 0x80) => "Conflicting Attributes",
            (Sct::CommandSpecific, 0x82) => "Attempted Write to Read Only Range",
            (Sct::MediaAndDataIntegrity, 0x80) => "Write Fault",
            (Sct::MediaAndDataIntegrity, 0x81) => "Unrecovered Read Error",
            (Sct::MediaAndDataIntegrity, 0x85) => "Compare Failure",
            (Sct::MediaAndDataIntegrity, 0x86) => "Access Denied",
            (Sct::MediaAndDataIntegrity, 0x87) => "Deallocated or Unwritten Logical Block",
            (Sct::Path, 0x00) => "Internal Path Error",
            _ => return None,
        };
        Some(name)
    }
}

/// `NVMe status 0x400f (generic: Data SGL Length Invalid)`.
impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NVMe status {:#06x} ({}: ", self.0, self.sct().name())?;
        match self.name() {
            Some(name) => write!(f, "{name})"),
            None => write!(f, "status code {:#04x})", self.sc()),
        }
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({self})")
    }
}

impl std::error::Error for Status {}

// --------------------------------------------------------- SGL descriptors --

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
    KeyedDataBlock = 0x4,
    TransportDataBlock = 0x5,
    VendorSpecific = 0xf,
}

impl SglType {
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
pub const SGL_ID_BIT_BUCKET: u8 = (SglType::BitBucket as u8) << 4;
pub const SGL_ID_SEGMENT: u8 = (SglType::Segment as u8) << 4;
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

// --------------------------------------------------------------------- PRP --

/// A DMA extent (device-visible address and byte length) to describe with PRPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Extent {
    pub addr: u64,
    pub len: u64,
}

impl From<SglDescriptor> for Extent {
    fn from(d: SglDescriptor) -> Extent {
        Extent {
            addr: d.addr,
            len: d.len as u64,
        }
    }
}

impl From<&SglDescriptor> for Extent {
    fn from(d: &SglDescriptor) -> Extent {
        Extent::from(*d)
    }
}

impl From<&Extent> for Extent {
    fn from(e: &Extent) -> Extent {
        *e
    }
}

/// Why memory cannot be described with PRPs (or the PRP list does not fit).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrpError {
    #[error("PRP: memory page size {0} is not a power of two of at least 4096")]
    PageSize(u64),
    #[error("PRP: a transfer of 0 bytes has no data pointer")]
    Empty,
    #[error("PRP: extent {index} has length 0")]
    EmptyExtent { index: usize },
    #[error("PRP: extent {index} at {addr:#x} + {len} bytes wraps the address space")]
    Overflow { index: usize, addr: u64, len: u64 },
    #[error("PRP: the first extent starts at {addr:#x}, which is not 4-byte aligned")]
    UnalignedFirst { addr: u64 },
    #[error("PRP: extent {index} starts at {addr:#x}, not on a {page}-byte page boundary; only the first extent may start mid-page (use an SGL for scattered memory)")]
    UnalignedStart { index: usize, addr: u64, page: u64 },
    #[error("PRP: extent {index} ends at {end:#x}, not on a {page}-byte page boundary; only the last extent may end mid-page (use an SGL for scattered memory)")]
    UnalignedEnd { index: usize, end: u64, page: u64 },
    #[error("PRP: the PRP list at {addr:#x} is not aligned to the {page}-byte page")]
    ListUnaligned { addr: u64, page: u64 },
    #[error("PRP: {entries} list entries need {pages} list page(s) of {page} bytes, but the list buffer holds {have} entries")]
    ListTooSmall {
        entries: usize,
        pages: usize,
        page: u64,
        have: usize,
    },
}

fn check_page(page: u64) -> Result<(), PrpError> {
    if page < 4096 || !page.is_power_of_two() {
        return Err(PrpError::PageSize(page));
    }
    Ok(())
}

/// Validates `extents` against PRP's rules and counts the PRP entries (one
/// per memory page touched). The first extent may start at any dword-aligned
/// offset; every later one must start on a page boundary, and every one but
/// the last must end on one.
pub fn prp_entry_count<I>(extents: I, page: u64) -> Result<usize, PrpError>
where
    I: IntoIterator,
    I::Item: Into<Extent>,
{
    check_page(page)?;
    let extents: Vec<Extent> = extents.into_iter().map(Into::into).collect();
    validate_extents(&extents, page)?;
    Ok(count_entries(&extents, page))
}

fn validate_extents(extents: &[Extent], page: u64) -> Result<(), PrpError> {
    if extents.is_empty() {
        return Err(PrpError::Empty);
    }
    let last = extents.len() - 1;
    for (index, e) in extents.iter().enumerate() {
        if e.len == 0 {
            return Err(PrpError::EmptyExtent { index });
        }
        let end = e.addr.checked_add(e.len).ok_or(PrpError::Overflow {
            index,
            addr: e.addr,
            len: e.len,
        })?;
        if index == 0 {
            if e.addr % 4 != 0 {
                return Err(PrpError::UnalignedFirst { addr: e.addr });
            }
        } else if e.addr % page != 0 {
            return Err(PrpError::UnalignedStart {
                index,
                addr: e.addr,
                page,
            });
        }
        if index != last && end % page != 0 {
            return Err(PrpError::UnalignedEnd { index, end, page });
        }
    }
    Ok(())
}

fn count_entries(extents: &[Extent], page: u64) -> usize {
    extents
        .iter()
        .map(|e| ((e.addr % page) + e.len).div_ceil(page) as usize)
        .sum()
}

/// The PRP entries of validated extents, in order: the first byte's address,
/// then the start of every further page.
fn entries(extents: &[Extent], page: u64) -> impl Iterator<Item = u64> + '_ {
    extents.iter().flat_map(move |e| {
        let first_page = e.addr & !(page - 1);
        let pages = ((e.addr % page) + e.len).div_ceil(page);
        (0..pages).map(move |i| {
            if i == 0 {
                e.addr
            } else {
                first_page + i * page
            }
        })
    })
}

/// PRP list pages needed for `entries` PRP entries in all (PRP1 included):
/// none for up to two; else the list holds `entries - 1`, `page / 8` per page,
/// the last slot of each full page but the last pointing at the next page.
pub const fn prp_list_pages_for_entries(entries: usize, page: u64) -> usize {
    if entries <= 2 {
        return 0;
    }
    let list = entries - 1;
    let per_page = (page / 8) as usize;
    if list <= per_page {
        1
    } else {
        (list - 1).div_ceil(per_page - 1)
    }
}

/// PRP list pages needed for a `len`-byte transfer that starts on a page
/// boundary (kvtier's DMA buffers do). A transfer starting mid-page touches
/// one page more: count it with [`prp_entry_count`] and
/// [`prp_list_pages_for_entries`].
pub const fn prp_list_pages_needed(len: u64, page: u64) -> usize {
    prp_list_pages_for_entries(len.div_ceil(page) as usize, page)
}

/// A command's PRPs, as built by [`build_prps`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prps {
    pub prp1: u64,
    pub prp2: u64,
    /// PRP entries in all (PRP1 included): the memory pages touched.
    pub entries: usize,
    /// Slots of the list buffer written (entries and chain pointers); 0 when
    /// no list is needed.
    pub list_slots: usize,
}

impl Prps {
    pub const fn data_ptr(&self) -> DataPtr {
        DataPtr::Prp {
            prp1: self.prp1,
            prp2: self.prp2,
        }
    }
}

/// Describes `extents` with PRP1, PRP2 and, past two pages, a PRP list
/// written into `list` (memory the controller reads at DMA address
/// `list_dma`, page-aligned and DMA-contiguous for as many pages as
/// [`prp_list_pages_for_entries`] says; `list` may be empty when at most two
/// pages are touched). When the list spans pages, the last slot of each full
/// page holds the DMA address of the next page, as the spec requires.
pub fn build_prps<I>(
    extents: I,
    page: u64,
    list: &mut [u64],
    list_dma: u64,
) -> Result<Prps, PrpError>
where
    I: IntoIterator,
    I::Item: Into<Extent>,
{
    check_page(page)?;
    let extents: Vec<Extent> = extents.into_iter().map(Into::into).collect();
    validate_extents(&extents, page)?;
    let n = count_entries(&extents, page);
    let mut it = entries(&extents, page);
    let prp1 = it
        .next()
        .expect("validated extents touch at least one page");
    if n <= 2 {
        let prp2 = it.next().unwrap_or(0);
        return Ok(Prps {
            prp1,
            prp2,
            entries: n,
            list_slots: 0,
        });
    }
    if list_dma % page != 0 {
        return Err(PrpError::ListUnaligned {
            addr: list_dma,
            page,
        });
    }
    let pages = prp_list_pages_for_entries(n, page);
    let per_page = (page / 8) as usize;
    // The n - 1 entries after PRP1, plus a chain pointer per extra page.
    let need = (n - 1) + (pages - 1);
    if list.len() < need {
        return Err(PrpError::ListTooSmall {
            entries: n - 1,
            pages,
            page,
            have: list.len(),
        });
    }
    let mut slot = 0usize;
    let mut remaining = n - 1;
    for entry in it {
        if slot % per_page == per_page - 1 && remaining > 1 {
            list[slot] = list_dma + (slot as u64 + 1) * 8;
            slot += 1;
        }
        list[slot] = entry;
        slot += 1;
        remaining -= 1;
    }
    debug_assert_eq!(slot, need);
    Ok(Prps {
        prp1,
        prp2: list_dma,
        entries: n,
        list_slots: slot,
    })
}

// --------------------------------------------------- controller registers --

/// Offsets of the controller registers in BAR0.
pub mod reg {
    /// Controller Capabilities (64-bit).
    pub const CAP: usize = 0x00;
    /// Version (32-bit).
    pub const VS: usize = 0x08;
    /// Interrupt Mask Set / Clear (32-bit).
    pub const INTMS: usize = 0x0c;
    pub const INTMC: usize = 0x10;
    /// Controller Configuration (32-bit).
    pub const CC: usize = 0x14;
    /// Controller Status (32-bit).
    pub const CSTS: usize = 0x1c;
    /// NVM Subsystem Reset (32-bit).
    pub const NSSR: usize = 0x20;
    /// Admin Queue Attributes (32-bit).
    pub const AQA: usize = 0x24;
    /// Admin Submission / Completion Queue Base Address (64-bit).
    pub const ASQ: usize = 0x28;
    pub const ACQ: usize = 0x30;
    /// First doorbell (admin SQ tail).
    pub const DOORBELL_BASE: usize = 0x1000;
}

/// BAR0 offset of submission queue `qid`'s tail doorbell:
/// `0x1000 + (2 * qid) * (4 << dstrd)`.
pub const fn sq_tail_doorbell(qid: u16, dstrd: u8) -> usize {
    reg::DOORBELL_BASE + (2 * qid as usize) * (4usize << dstrd)
}

/// BAR0 offset of completion queue `qid`'s head doorbell:
/// `0x1000 + (2 * qid + 1) * (4 << dstrd)`.
pub const fn cq_head_doorbell(qid: u16, dstrd: u8) -> usize {
    reg::DOORBELL_BASE + (2 * qid as usize + 1) * (4usize << dstrd)
}

/// Bytes of BAR0 needed to reach the doorbells of queues `0..=max_qid`.
pub const fn bar0_len_for_queues(max_qid: u16, dstrd: u8) -> usize {
    cq_head_doorbell(max_qid, dstrd) + 4
}

/// CAP bit positions.
pub mod cap {
    pub const MQES_MASK: u64 = 0xffff;
    pub const CQR: u64 = 1 << 16;
    pub const AMS_SHIFT: u32 = 17;
    pub const TO_SHIFT: u32 = 24;
    pub const DSTRD_SHIFT: u32 = 32;
    pub const NSSRS: u64 = 1 << 36;
    pub const CSS_SHIFT: u32 = 37;
    /// CAP.CSS bit 0: the NVM command set.
    pub const CSS_NVM: u64 = 1 << 37;
    pub const MPSMIN_SHIFT: u32 = 48;
    pub const MPSMAX_SHIFT: u32 = 52;
}

/// Controller Capabilities.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cap(pub u64);

impl Cap {
    /// MQES: the largest queue size in entries (the field is 0-based).
    pub const fn max_queue_entries(self) -> u32 {
        (self.0 & cap::MQES_MASK) as u32 + 1
    }

    /// Contiguous Queues Required.
    pub const fn cqr(self) -> bool {
        self.0 & cap::CQR != 0
    }

    /// Arbitration Mechanisms Supported beyond round robin (bits: WRR, vendor).
    pub const fn ams(self) -> u8 {
        ((self.0 >> cap::AMS_SHIFT) & 0x3) as u8
    }

    /// TO: worst-case time for CSTS.RDY to change after CC.EN does, in ms.
    pub const fn timeout_ms(self) -> u64 {
        ((self.0 >> cap::TO_SHIFT) & 0xff) * 500
    }

    /// DSTRD: doorbells are `4 << dstrd` bytes apart.
    pub const fn dstrd(self) -> u8 {
        ((self.0 >> cap::DSTRD_SHIFT) & 0xf) as u8
    }

    pub const fn nssrs(self) -> bool {
        self.0 & cap::NSSRS != 0
    }

    /// Command Sets Supported (CAP.CSS, 8 bits).
    pub const fn css(self) -> u8 {
        ((self.0 >> cap::CSS_SHIFT) & 0xff) as u8
    }

    pub const fn supports_nvm(self) -> bool {
        self.0 & cap::CSS_NVM != 0
    }

    /// Smallest memory page size, in bytes (`2^(12 + MPSMIN)`).
    pub const fn mpsmin_bytes(self) -> u64 {
        1 << (12 + ((self.0 >> cap::MPSMIN_SHIFT) & 0xf))
    }

    /// Largest memory page size, in bytes (`2^(12 + MPSMAX)`).
    pub const fn mpsmax_bytes(self) -> u64 {
        1 << (12 + ((self.0 >> cap::MPSMAX_SHIFT) & 0xf))
    }
}

/// Version: major.minor.tertiary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Vs(pub u32);

impl Vs {
    pub const fn new(major: u16, minor: u8, tertiary: u8) -> Vs {
        Vs(((major as u32) << 16) | ((minor as u32) << 8) | tertiary as u32)
    }
    pub const fn major(self) -> u16 {
        (self.0 >> 16) as u16
    }
    pub const fn minor(self) -> u8 {
        (self.0 >> 8) as u8
    }
    pub const fn tertiary(self) -> u8 {
        self.0 as u8
    }
}

impl fmt::Display for Vs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major(), self.minor(), self.tertiary())
    }
}

/// CC bit positions.
pub mod cc {
    pub const EN: u32 = 1 << 0;
    pub const CSS_SHIFT: u32 = 4;
    pub const MPS_SHIFT: u32 = 7;
    pub const AMS_SHIFT: u32 = 11;
    pub const SHN_SHIFT: u32 = 14;
    pub const SHN_MASK: u32 = 0x3 << SHN_SHIFT;
    pub const IOSQES_SHIFT: u32 = 16;
    pub const IOCQES_SHIFT: u32 = 20;
    /// CC.CSS value for the NVM command set.
    pub const CSS_NVM: u32 = 0;
    /// log2 of the SQE and CQE sizes, for IOSQES / IOCQES.
    pub const IOSQES_64B: u32 = 6;
    pub const IOCQES_16B: u32 = 4;
}

/// Shutdown Notification (CC.SHN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Shn {
    None = 0,
    Normal = 1,
    Abrupt = 2,
}

/// Controller Configuration.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cc(pub u32);

impl Cc {
    /// What kvtier enables a controller with: EN, the NVM command set,
    /// memory pages of `2^(12 + mps)` bytes, round-robin arbitration, 64-byte
    /// SQEs and 16-byte CQEs.
    pub const fn nvm_enable(mps: u8) -> Cc {
        Cc(cc::EN
            | (cc::CSS_NVM << cc::CSS_SHIFT)
            | (((mps & 0xf) as u32) << cc::MPS_SHIFT)
            | (cc::IOSQES_64B << cc::IOSQES_SHIFT)
            | (cc::IOCQES_16B << cc::IOCQES_SHIFT))
    }

    pub const fn en(self) -> bool {
        self.0 & cc::EN != 0
    }
    pub const fn with_en(self, en: bool) -> Cc {
        Cc(if en {
            self.0 | cc::EN
        } else {
            self.0 & !cc::EN
        })
    }
    pub const fn css(self) -> u8 {
        ((self.0 >> cc::CSS_SHIFT) & 0x7) as u8
    }
    /// The memory page size selected, in bytes.
    pub const fn page_bytes(self) -> u64 {
        1 << (12 + ((self.0 >> cc::MPS_SHIFT) & 0xf))
    }
    pub const fn ams(self) -> u8 {
        ((self.0 >> cc::AMS_SHIFT) & 0x7) as u8
    }
    pub const fn shn(self) -> u8 {
        ((self.0 & cc::SHN_MASK) >> cc::SHN_SHIFT) as u8
    }
    pub const fn with_shn(self, shn: Shn) -> Cc {
        Cc((self.0 & !cc::SHN_MASK) | ((shn as u32) << cc::SHN_SHIFT))
    }
    pub const fn iosqes(self) -> u8 {
        ((self.0 >> cc::IOSQES_SHIFT) & 0xf) as u8
    }
    pub const fn iocqes(self) -> u8 {
        ((self.0 >> cc::IOCQES_SHIFT) & 0xf) as u8
    }
}

/// CSTS bit positions.
pub mod csts {
    pub const RDY: u32 = 1 << 0;
    pub const CFS: u32 = 1 << 1;
    pub const SHST_SHIFT: u32 = 2;
    pub const SHST_MASK: u32 = 0x3 << SHST_SHIFT;
    pub const NSSRO: u32 = 1 << 4;
    pub const PP: u32 = 1 << 5;
}

/// Shutdown Status (CSTS.SHST).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shst {
    Normal,
    Occurring,
    Complete,
    Reserved,
}

/// Controller Status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Csts(pub u32);

impl Csts {
    pub const fn rdy(self) -> bool {
        self.0 & csts::RDY != 0
    }
    /// Controller Fatal Status: the controller needs a reset.
    pub const fn cfs(self) -> bool {
        self.0 & csts::CFS != 0
    }
    pub const fn shst(self) -> Shst {
        match (self.0 & csts::SHST_MASK) >> csts::SHST_SHIFT {
            0 => Shst::Normal,
            1 => Shst::Occurring,
            2 => Shst::Complete,
            _ => Shst::Reserved,
        }
    }
    pub const fn nssro(self) -> bool {
        self.0 & csts::NSSRO != 0
    }
    pub const fn pp(self) -> bool {
        self.0 & csts::PP != 0
    }
}

/// Largest admin queue the 12-bit AQA fields describe.
pub const ADMIN_QUEUE_MAX_ENTRIES: u16 = 4096;

/// AQA for an admin SQ of `sq_entries` and CQ of `cq_entries` entries
/// (2..=4096 each; the fields are 0-based); `None` outside that range.
pub const fn aqa(sq_entries: u16, cq_entries: u16) -> Option<u32> {
    if sq_entries < 2
        || cq_entries < 2
        || sq_entries > ADMIN_QUEUE_MAX_ENTRIES
        || cq_entries > ADMIN_QUEUE_MAX_ENTRIES
    {
        return None;
    }
    Some((((cq_entries - 1) as u32) << 16) | (sq_entries - 1) as u32)
}

// ----------------------------------------------------------------- Identify --

/// Byte offsets in the Identify Controller data structure.
pub mod idctl {
    /// PCI Vendor ID (u16).
    pub const VID: usize = 0;
    /// PCI Subsystem Vendor ID (u16).
    pub const SSVID: usize = 2;
    /// Serial Number (ASCII, space padded).
    pub const SN: usize = 4;
    pub const SN_LEN: usize = 20;
    /// Model Number (ASCII, space padded).
    pub const MN: usize = 24;
    pub const MN_LEN: usize = 40;
    /// Firmware Revision (ASCII, space padded).
    pub const FR: usize = 64;
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
    pub const NSFEAT: usize = 24;
    /// Number of LBA Formats, 0-based.
    pub const NLBAF: usize = 25;
    /// Formatted LBA Size: format index bits 3:0 (+ bits 6:5 as index
    /// bits 5:4 when more than 16 formats), bit 4 metadata at end of LBA.
    pub const FLBAS: usize = 26;
    /// LBA Format table: `LBAF_LEN`-byte entries (MS bits 15:0, LBADS
    /// bits 23:16 as log2 bytes, RP bits 25:24).
    pub const LBAF: usize = 128;
    pub const LBAF_LEN: usize = 4;
    /// Entries the Identify Namespace structure has room for.
    pub const LBAF_MAX: usize = 64;
}

/// SGLS bits (Identify Controller).
pub mod sgls {
    /// Bits 1:0: 00 no SGLs, 01 SGLs with no alignment rule, 10 SGLs whose
    /// Data Blocks must be dword aligned, 11 reserved.
    pub const SUPPORT_MASK: u32 = 0x3;
    pub const SUPPORT_DWORD_ALIGNED: u32 = 0x2;
    pub const KEYED: u32 = 1 << 2;
    pub const BIT_BUCKET: u32 = 1 << 16;
    pub const BYTE_ALIGNED_MPTR: u32 = 1 << 17;
    /// An SGL longer than the transfer is allowed (excess ignored).
    pub const LONGER_THAN_DATA: u32 = 1 << 18;
    pub const MPTR_SGL: u32 = 1 << 19;
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
    pub vid: u16,
    pub ssvid: u16,
    pub serial: String,
    pub model: String,
    pub firmware: String,
    /// Raw MDTS (see [`IdentifyController::max_transfer_bytes`]).
    pub mdts: u8,
    pub cntlid: u16,
    pub ver: Vs,
    pub oacs: u16,
    pub sqes: u8,
    pub cqes: u8,
    pub maxcmd: u16,
    /// Number of namespaces (largest NSID).
    pub nn: u32,
    pub oncs: u16,
    pub vwc: u8,
    /// SGL Support; see [`sgls`].
    pub sgls: u32,
}

impl IdentifyController {
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
    #[error("Identify Namespace: formatted LBA format {index} is past the {count} format(s) reported (NLBAF)")]
    FormatIndex { index: usize, count: usize },
    #[error("Identify Namespace: LBA format {index} has LBADS {lbads} (LBAs of 2^{lbads} bytes); 9..=16 (512 B to 64 KiB) is expected")]
    LbaSize { index: usize, lbads: u8 },
}

/// The Identify Namespace fields kvtier uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifyNamespace {
    /// Size in logical blocks (0 for an inactive NSID).
    pub nsze: u64,
    pub ncap: u64,
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
    pub lba_formats: Vec<LbaFormat>,
}

impl IdentifyNamespace {
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

// ------------------------------------------------------------------ asserts --

const _: () = {
    assert!(size_of::<Sqe>() == 64);
    assert!(offset_of!(Sqe, opcode) == 0);
    assert!(offset_of!(Sqe, flags) == 1);
    assert!(offset_of!(Sqe, cid) == 2);
    assert!(offset_of!(Sqe, nsid) == 4);
    assert!(offset_of!(Sqe, cdw2) == 8);
    assert!(offset_of!(Sqe, cdw3) == 12);
    assert!(offset_of!(Sqe, mptr) == 16);
    assert!(offset_of!(Sqe, dptr) == 24);
    assert!(offset_of!(Sqe, cdw10) == 40);
    assert!(offset_of!(Sqe, cdw11) == 44);
    assert!(offset_of!(Sqe, cdw12) == 48);
    assert!(offset_of!(Sqe, cdw13) == 52);
    assert!(offset_of!(Sqe, cdw14) == 56);
    assert!(offset_of!(Sqe, cdw15) == 60);

    assert!(size_of::<Dptr>() == 16);
    assert!(offset_of!(Dptr, prp1) == 0);
    assert!(offset_of!(Dptr, prp2) == 8);
    assert!(size_of::<Dptr>() == size_of::<SglDescriptor>());

    // Alignment as in the C header: kernels load SQEs with 8-byte accesses.
    assert!(std::mem::align_of::<Sqe>() == 8);
    assert!(std::mem::align_of::<Cqe>() == 4);

    assert!(size_of::<Cqe>() == 16);
    assert!(offset_of!(Cqe, dw0) == 0);
    assert!(offset_of!(Cqe, dw1) == 4);
    assert!(offset_of!(Cqe, sq_head) == 8);
    assert!(offset_of!(Cqe, sq_id) == 10);
    assert!(offset_of!(Cqe, cid) == 12);
    assert!(offset_of!(Cqe, status) == 14);

    // The P2P table's descriptor is the spec's SGL descriptor.
    assert!(size_of::<SglDescriptor>() == SGL_DESCRIPTOR_LEN as usize);
    assert!(offset_of!(SglDescriptor, addr) == 0);
    assert!(offset_of!(SglDescriptor, len) == 8);
    assert!(offset_of!(SglDescriptor, sgl_id) == 15);
    assert!(SGL_ID_DATA_BLOCK == (SglType::DataBlock as u8) << 4 | SGL_SUBTYPE_ADDRESS);

    assert!(offset_of!(SglDescriptor, reserved) == 12);
    assert!(SGL_ID_DATA_BLOCK == 0x00);
    // NVMe status codes stay below the engine-defined IOCTX statuses.
    assert!(STATUS_SCT_MASK | STATUS_SC_MASK == 0x07ff);

    assert!(idctl::SGLS + 4 <= IDENTIFY_DATA_LEN);
    assert!(idns::LBAF + idns::LBAF_MAX * idns::LBAF_LEN <= IDENTIFY_DATA_LEN);
};

// ------------------------------------------------------------- C header twin --

/// `NAME = value, ...` into `(String, u64)` pairs (a macro so the long list
/// stays one line per constant).
macro_rules! c_constants {
    ($($name:ident = $value:expr,)*) => {
        vec![$((stringify!($name).to_string(), ($value) as u64)),*]
    };
}

/// Constants `kernels/nvme_spec.h` must define with these values (the header
/// test generates a `static_assert` for each). A name with arguments, like
/// `KVTIER_NVME_SQ_TAIL_DOORBELL(1, 2)`, is a macro call checked by value.
pub fn nvme_constants() -> Vec<(String, u64)> {
    let mut v = c_constants! {
        KVTIER_NVME_SQE_SIZE = size_of::<Sqe>(),
        KVTIER_NVME_CQE_SIZE = size_of::<Cqe>(),
        KVTIER_NVME_SGL_DESC_SIZE = SGL_DESCRIPTOR_LEN,
        KVTIER_NVME_IDENTIFY_DATA_LEN = IDENTIFY_DATA_LEN,
        // opcodes
        KVTIER_NVME_ADMIN_DELETE_IO_SQ = admin_opc::DELETE_IO_SQ,
        KVTIER_NVME_ADMIN_CREATE_IO_SQ = admin_opc::CREATE_IO_SQ,
        KVTIER_NVME_ADMIN_GET_LOG_PAGE = admin_opc::GET_LOG_PAGE,
        KVTIER_NVME_ADMIN_DELETE_IO_CQ = admin_opc::DELETE_IO_CQ,
        KVTIER_NVME_ADMIN_CREATE_IO_CQ = admin_opc::CREATE_IO_CQ,
        KVTIER_NVME_ADMIN_IDENTIFY = admin_opc::IDENTIFY,
        KVTIER_NVME_ADMIN_ABORT = admin_opc::ABORT,
        KVTIER_NVME_ADMIN_SET_FEATURES = admin_opc::SET_FEATURES,
        KVTIER_NVME_ADMIN_GET_FEATURES = admin_opc::GET_FEATURES,
        KVTIER_NVME_OPC_FLUSH = nvm_opc::FLUSH,
        KVTIER_NVME_OPC_WRITE = nvm_opc::WRITE,
        KVTIER_NVME_OPC_READ = nvm_opc::READ,
        KVTIER_NVME_CNS_NAMESPACE = cns::NAMESPACE,
        KVTIER_NVME_CNS_CONTROLLER = cns::CONTROLLER,
        KVTIER_NVME_CNS_ACTIVE_NAMESPACES = cns::ACTIVE_NAMESPACES,
        KVTIER_NVME_FEAT_NUMBER_OF_QUEUES = feature::NUMBER_OF_QUEUES,
        // SQE flags
        KVTIER_NVME_SQE_FLAGS_FUSE_MASK = SQE_FLAGS_FUSE_MASK,
        KVTIER_NVME_SQE_FLAGS_PSDT_SHIFT = SQE_FLAGS_PSDT_SHIFT,
        KVTIER_NVME_SQE_FLAGS_PSDT_MASK = SQE_FLAGS_PSDT_MASK,
        KVTIER_NVME_FUSE_NORMAL = Fuse::Normal,
        KVTIER_NVME_FUSE_FIRST = Fuse::First,
        KVTIER_NVME_FUSE_SECOND = Fuse::Second,
        KVTIER_NVME_PSDT_PRP = Psdt::Prp,
        KVTIER_NVME_PSDT_SGL_MPTR_CONTIG = Psdt::SglMptrContiguous,
        KVTIER_NVME_PSDT_SGL_MPTR_SGL = Psdt::SglMptrSgl,
        KVTIER_NVME_PSDT_RESERVED = Psdt::Reserved,
        // CQE status
        KVTIER_NVME_CQE_STATUS_PHASE = CQE_STATUS_PHASE,
        KVTIER_NVME_STATUS_SC_MASK = STATUS_SC_MASK,
        KVTIER_NVME_STATUS_SCT_SHIFT = STATUS_SCT_SHIFT,
        KVTIER_NVME_STATUS_SCT_MASK = STATUS_SCT_MASK,
        KVTIER_NVME_STATUS_CRD_SHIFT = STATUS_CRD_SHIFT,
        KVTIER_NVME_STATUS_CRD_MASK = STATUS_CRD_MASK,
        KVTIER_NVME_STATUS_MORE = STATUS_MORE,
        KVTIER_NVME_STATUS_DNR = STATUS_DNR,
        KVTIER_NVME_STATUS_DATA_SGL_LENGTH_INVALID = Status::DATA_SGL_LENGTH_INVALID.raw(),
        KVTIER_NVME_STATUS_INVALID_FIELD = Status::INVALID_FIELD.raw(),
        KVTIER_NVME_STATUS_LBA_OUT_OF_RANGE = Status::LBA_OUT_OF_RANGE.raw(),
        // SGL
        KVTIER_NVME_SGL_TYPE_DATA_BLOCK = SglType::DataBlock,
        KVTIER_NVME_SGL_TYPE_BIT_BUCKET = SglType::BitBucket,
        KVTIER_NVME_SGL_TYPE_SEGMENT = SglType::Segment,
        KVTIER_NVME_SGL_TYPE_LAST_SEGMENT = SglType::LastSegment,
        KVTIER_NVME_SGL_SUBTYPE_ADDRESS = SGL_SUBTYPE_ADDRESS,
        KVTIER_NVME_SGL_ID_DATA_BLOCK = SGL_ID_DATA_BLOCK,
        KVTIER_NVME_SGL_ID_BIT_BUCKET = SGL_ID_BIT_BUCKET,
        KVTIER_NVME_SGL_ID_SEGMENT = SGL_ID_SEGMENT,
        KVTIER_NVME_SGL_ID_LAST_SEGMENT = SGL_ID_LAST_SEGMENT,
        // registers
        KVTIER_NVME_REG_CAP = reg::CAP,
        KVTIER_NVME_REG_VS = reg::VS,
        KVTIER_NVME_REG_INTMS = reg::INTMS,
        KVTIER_NVME_REG_INTMC = reg::INTMC,
        KVTIER_NVME_REG_CC = reg::CC,
        KVTIER_NVME_REG_CSTS = reg::CSTS,
        KVTIER_NVME_REG_NSSR = reg::NSSR,
        KVTIER_NVME_REG_AQA = reg::AQA,
        KVTIER_NVME_REG_ASQ = reg::ASQ,
        KVTIER_NVME_REG_ACQ = reg::ACQ,
        KVTIER_NVME_REG_DOORBELL_BASE = reg::DOORBELL_BASE,
        KVTIER_NVME_CAP_MQES_MASK = cap::MQES_MASK,
        KVTIER_NVME_CAP_CQR = cap::CQR,
        KVTIER_NVME_CAP_AMS_SHIFT = cap::AMS_SHIFT,
        KVTIER_NVME_CAP_TO_SHIFT = cap::TO_SHIFT,
        KVTIER_NVME_CAP_DSTRD_SHIFT = cap::DSTRD_SHIFT,
        KVTIER_NVME_CAP_NSSRS = cap::NSSRS,
        KVTIER_NVME_CAP_CSS_SHIFT = cap::CSS_SHIFT,
        KVTIER_NVME_CAP_CSS_NVM = cap::CSS_NVM,
        KVTIER_NVME_CAP_MPSMIN_SHIFT = cap::MPSMIN_SHIFT,
        KVTIER_NVME_CAP_MPSMAX_SHIFT = cap::MPSMAX_SHIFT,
        KVTIER_NVME_CC_EN = cc::EN,
        KVTIER_NVME_CC_CSS_SHIFT = cc::CSS_SHIFT,
        KVTIER_NVME_CC_MPS_SHIFT = cc::MPS_SHIFT,
        KVTIER_NVME_CC_AMS_SHIFT = cc::AMS_SHIFT,
        KVTIER_NVME_CC_SHN_SHIFT = cc::SHN_SHIFT,
        KVTIER_NVME_CC_SHN_MASK = cc::SHN_MASK,
        KVTIER_NVME_CC_IOSQES_SHIFT = cc::IOSQES_SHIFT,
        KVTIER_NVME_CC_IOCQES_SHIFT = cc::IOCQES_SHIFT,
        KVTIER_NVME_CSTS_RDY = csts::RDY,
        KVTIER_NVME_CSTS_CFS = csts::CFS,
        KVTIER_NVME_CSTS_SHST_SHIFT = csts::SHST_SHIFT,
        KVTIER_NVME_CSTS_SHST_MASK = csts::SHST_MASK,
        KVTIER_NVME_CSTS_NSSRO = csts::NSSRO,
        KVTIER_NVME_CSTS_PP = csts::PP,
        // Identify
        KVTIER_NVME_IDCTL_VID = idctl::VID,
        KVTIER_NVME_IDCTL_SSVID = idctl::SSVID,
        KVTIER_NVME_IDCTL_SN = idctl::SN,
        KVTIER_NVME_IDCTL_SN_LEN = idctl::SN_LEN,
        KVTIER_NVME_IDCTL_MN = idctl::MN,
        KVTIER_NVME_IDCTL_MN_LEN = idctl::MN_LEN,
        KVTIER_NVME_IDCTL_FR = idctl::FR,
        KVTIER_NVME_IDCTL_FR_LEN = idctl::FR_LEN,
        KVTIER_NVME_IDCTL_MDTS = idctl::MDTS,
        KVTIER_NVME_IDCTL_CNTLID = idctl::CNTLID,
        KVTIER_NVME_IDCTL_VER = idctl::VER,
        KVTIER_NVME_IDCTL_OACS = idctl::OACS,
        KVTIER_NVME_IDCTL_SQES = idctl::SQES,
        KVTIER_NVME_IDCTL_CQES = idctl::CQES,
        KVTIER_NVME_IDCTL_MAXCMD = idctl::MAXCMD,
        KVTIER_NVME_IDCTL_NN = idctl::NN,
        KVTIER_NVME_IDCTL_ONCS = idctl::ONCS,
        KVTIER_NVME_IDCTL_VWC = idctl::VWC,
        KVTIER_NVME_IDCTL_SGLS = idctl::SGLS,
        KVTIER_NVME_SGLS_SUPPORT_MASK = sgls::SUPPORT_MASK,
        KVTIER_NVME_SGLS_BIT_BUCKET = sgls::BIT_BUCKET,
        KVTIER_NVME_IDNS_NSZE = idns::NSZE,
        KVTIER_NVME_IDNS_NCAP = idns::NCAP,
        KVTIER_NVME_IDNS_NUSE = idns::NUSE,
        KVTIER_NVME_IDNS_NLBAF = idns::NLBAF,
        KVTIER_NVME_IDNS_FLBAS = idns::FLBAS,
        KVTIER_NVME_IDNS_LBAF = idns::LBAF,
        KVTIER_NVME_IDNS_LBAF_LEN = idns::LBAF_LEN,
    };
    // Doorbell macros, checked at a few points against the Rust functions.
    for (qid, dstrd) in [(0u16, 0u8), (1, 0), (7, 0), (0, 2), (1, 2), (63, 3)] {
        v.push((
            format!("KVTIER_NVME_SQ_TAIL_DOORBELL({qid}, {dstrd})"),
            sq_tail_doorbell(qid, dstrd) as u64,
        ));
        v.push((
            format!("KVTIER_NVME_CQ_HEAD_DOORBELL({qid}, {dstrd})"),
            cq_head_doorbell(qid, dstrd) as u64,
        ));
    }
    v
}

/// Struct layouts `kernels/nvme_spec.h` must match: (C type, C member or
/// `None` for the struct's size, value). The header test turns each into a
/// `static_assert` on `sizeof` / `offsetof`.
pub fn nvme_layouts() -> Vec<(&'static str, Option<&'static str>, usize)> {
    vec![
        ("kvtier_nvme_sqe", None, size_of::<Sqe>()),
        ("kvtier_nvme_sqe", Some("opcode"), offset_of!(Sqe, opcode)),
        ("kvtier_nvme_sqe", Some("flags"), offset_of!(Sqe, flags)),
        ("kvtier_nvme_sqe", Some("cid"), offset_of!(Sqe, cid)),
        ("kvtier_nvme_sqe", Some("nsid"), offset_of!(Sqe, nsid)),
        ("kvtier_nvme_sqe", Some("cdw2"), offset_of!(Sqe, cdw2)),
        ("kvtier_nvme_sqe", Some("cdw3"), offset_of!(Sqe, cdw3)),
        ("kvtier_nvme_sqe", Some("mptr"), offset_of!(Sqe, mptr)),
        ("kvtier_nvme_sqe", Some("dptr"), offset_of!(Sqe, dptr)),
        ("kvtier_nvme_sqe", Some("cdw10"), offset_of!(Sqe, cdw10)),
        ("kvtier_nvme_sqe", Some("cdw11"), offset_of!(Sqe, cdw11)),
        ("kvtier_nvme_sqe", Some("cdw12"), offset_of!(Sqe, cdw12)),
        ("kvtier_nvme_sqe", Some("cdw13"), offset_of!(Sqe, cdw13)),
        ("kvtier_nvme_sqe", Some("cdw14"), offset_of!(Sqe, cdw14)),
        ("kvtier_nvme_sqe", Some("cdw15"), offset_of!(Sqe, cdw15)),
        ("kvtier_nvme_dptr", None, size_of::<Dptr>()),
        ("kvtier_nvme_dptr", Some("prp.prp1"), offset_of!(Dptr, prp1)),
        ("kvtier_nvme_dptr", Some("prp.prp2"), offset_of!(Dptr, prp2)),
        (
            "kvtier_nvme_dptr",
            Some("sgl1.addr"),
            offset_of!(SglDescriptor, addr),
        ),
        (
            "kvtier_nvme_dptr",
            Some("sgl1.len"),
            offset_of!(SglDescriptor, len),
        ),
        (
            "kvtier_nvme_dptr",
            Some("sgl1.sgl_id"),
            offset_of!(SglDescriptor, sgl_id),
        ),
        ("kvtier_nvme_cqe", None, size_of::<Cqe>()),
        ("kvtier_nvme_cqe", Some("dw0"), offset_of!(Cqe, dw0)),
        ("kvtier_nvme_cqe", Some("dw1"), offset_of!(Cqe, dw1)),
        ("kvtier_nvme_cqe", Some("sq_head"), offset_of!(Cqe, sq_head)),
        ("kvtier_nvme_cqe", Some("sq_id"), offset_of!(Cqe, sq_id)),
        ("kvtier_nvme_cqe", Some("cid"), offset_of!(Cqe, cid)),
        ("kvtier_nvme_cqe", Some("status"), offset_of!(Cqe, status)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;

    #[test]
    fn read_with_prps_encodes_every_byte() {
        let sqe = Sqe::read(
            0x1234,
            1,
            0x0000_0001_0000_0040,
            255,
            DataPtr::Prp {
                prp1: 0x1000_0000,
                prp2: 0x1000_1000,
            },
        );
        let b: [u8; 64] = bytemuck::cast(sqe);
        assert_eq!(b[0], 0x02, "opcode");
        assert_eq!(b[1], 0x00, "PSDT 00b, FUSE 00b");
        assert_eq!(&b[2..4], &0x1234u16.to_le_bytes(), "cid");
        assert_eq!(&b[4..8], &1u32.to_le_bytes(), "nsid");
        assert_eq!(&b[24..32], &0x1000_0000u64.to_le_bytes(), "prp1");
        assert_eq!(&b[32..40], &0x1000_1000u64.to_le_bytes(), "prp2");
        assert_eq!(&b[40..44], &0x40u32.to_le_bytes(), "cdw10 = SLBA low");
        assert_eq!(&b[44..48], &1u32.to_le_bytes(), "cdw11 = SLBA high");
        assert_eq!(&b[48..52], &255u32.to_le_bytes(), "cdw12 = NLB 0-based");
        assert_eq!(sqe.slba(), 0x0000_0001_0000_0040);
        assert_eq!(sqe.nlb(), 256);
        let back: Sqe = bytemuck::cast(b);
        assert_eq!(back, sqe);
        assert_eq!(
            back.data_ptr(),
            Some(DataPtr::Prp {
                prp1: 0x1000_0000,
                prp2: 0x1000_1000
            })
        );
    }

    #[test]
    fn write_with_sgl_sets_psdt_and_descriptor_bytes() {
        let desc = SglDescriptor::data_block(0xdead_b000, 65536);
        let sqe = Sqe::write(7, 1, 4096, 127, DataPtr::Sgl(desc));
        let b: [u8; 64] = bytemuck::cast(sqe);
        assert_eq!(b[0], 0x01);
        // nvmetest.c's PSDT_SGL is 1 << 14 in CDW0: bit 6 of byte 1.
        assert_eq!(b[1], 0x40);
        assert_eq!(
            u32::from_le_bytes(b[0..4].try_into().unwrap()) & 0xc000,
            1 << 14
        );
        assert_eq!(sqe.psdt(), Psdt::SglMptrContiguous);
        let desc_bytes: [u8; 16] = bytemuck::cast(desc);
        assert_eq!(&b[24..40], &desc_bytes);
        assert_eq!(b[39], SGL_ID_DATA_BLOCK);
        assert_eq!(sqe.data_ptr(), Some(DataPtr::Sgl(desc)));

        let seg = SglDescriptor::last_segment(0x2000, 5);
        let mut sqe = Sqe::read(1, 1, 64, 31, DataPtr::Sgl(seg));
        let b: [u8; 64] = bytemuck::cast(sqe);
        assert_eq!(b[39], 0x30);
        assert_eq!(&b[32..36], &80u32.to_le_bytes(), "5 descriptors = 80 bytes");
        sqe.set_psdt(Psdt::Reserved);
        assert_eq!(sqe.flags, 0xc0);
        assert_eq!(sqe.data_ptr(), None);
        sqe.set_fuse(Fuse::First);
        assert_eq!(sqe.flags, 0xc1);
        assert_eq!(sqe.fuse(), Fuse::First);
        assert_eq!(sqe.psdt(), Psdt::Reserved);
        sqe.set_data_ptr(DataPtr::Prp { prp1: 1, prp2: 2 });
        assert_eq!(sqe.flags, 0x01, "PRP clears PSDT, keeps FUSE");
    }

    #[test]
    fn admin_constructors_match_nvmetest() {
        let e = Sqe::identify(1, cns::CONTROLLER, 0, 0x4000);
        assert_eq!(
            (e.opcode, e.cdw10, e.dptr.prp1, e.nsid),
            (0x06, 1, 0x4000, 0)
        );
        let e = Sqe::identify(2, cns::NAMESPACE, 1, 0x4000);
        assert_eq!((e.cdw10, e.nsid), (0, 1));

        let e = Sqe::create_io_cq(3, 1, 256, 0x8000, None);
        assert_eq!((e.opcode, e.cdw10, e.cdw11), (0x05, (255 << 16) | 1, 1));
        assert_eq!(e.dptr.prp1, 0x8000);
        let e = Sqe::create_io_cq(3, 2, 64, 0x8000, Some(3));
        assert_eq!(e.cdw11, (3 << 16) | 0b11);

        let e = Sqe::create_io_sq(4, 1, 256, 0x9000, 1);
        assert_eq!((e.opcode, e.cdw10), (0x01, (255 << 16) | 1));
        assert_eq!(e.cdw11 >> 16, 1, "CQID");
        assert_eq!(e.cdw11 & 1, 1, "PC");

        let e = Sqe::delete_io_sq(5, 1);
        assert_eq!((e.opcode, e.cdw10), (0x00, 1));
        let e = Sqe::delete_io_cq(6, 1);
        assert_eq!((e.opcode, e.cdw10), (0x04, 1));

        let e = Sqe::set_features_num_queues(7, 4, 2);
        assert_eq!((e.opcode, e.cdw10, e.cdw11), (0x09, 0x07, (1 << 16) | 3));
        assert_eq!(allocated_queues(0x003f_003f), (64, 64));

        let e = Sqe::flush(8, 1);
        assert_eq!((e.opcode, e.nsid, e.cid, e.flags), (0x00, 1, 8, 0));
    }

    #[test]
    fn cqe_status_field_and_phase() {
        let mut b = [0u8; 16];
        b[0..4].copy_from_slice(&0x003f_003fu32.to_le_bytes());
        b[8..10].copy_from_slice(&5u16.to_le_bytes());
        b[10..12].copy_from_slice(&1u16.to_le_bytes());
        b[12..14].copy_from_slice(&9u16.to_le_bytes());
        b[14..16].copy_from_slice(&((0x400fu16 << 1) | 1).to_le_bytes());
        let cqe: Cqe = bytemuck::cast(b);
        assert_eq!(
            (cqe.dw0, cqe.sq_head, cqe.sq_id, cqe.cid),
            (0x003f_003f, 5, 1, 9)
        );
        assert!(cqe.phase());
        assert_eq!(cqe.status().raw(), 0x400f);
        assert_eq!(
            Cqe::status_field(Status::from_raw(0x400f), true),
            cqe.status
        );
        let zero_phase = Cqe {
            status: Cqe::status_field(Status::SUCCESS, false),
            ..cqe
        };
        assert!(!zero_phase.phase());
        assert!(zero_phase.status().is_success());
    }

    #[test]
    fn status_decodes_qemu_values() {
        let s = Status::from_raw(0x400f);
        assert_eq!(
            (s.sct(), s.sc(), s.dnr(), s.more()),
            (Sct::Generic, 0x0f, true, false)
        );
        assert!(s.is(Status::DATA_SGL_LENGTH_INVALID));
        assert_eq!(s.code(), 0x000f);
        assert_eq!(Status::DATA_SGL_LENGTH_INVALID.with_dnr(), s);
        assert_eq!(
            s.to_string(),
            "NVMe status 0x400f (generic: Data SGL Length Invalid)"
        );

        let s = Status::from_raw(0x4002);
        assert!(s.is(Status::INVALID_FIELD) && s.dnr());
        assert_eq!(
            s.to_string(),
            "NVMe status 0x4002 (generic: Invalid Field in Command)"
        );

        let s = Status::from_raw(0x0080);
        assert!(s.is(Status::LBA_OUT_OF_RANGE) && !s.dnr());
        assert_eq!(
            s.to_string(),
            "NVMe status 0x0080 (generic: LBA Out of Range)"
        );

        let s = Status::from_raw(0x400d);
        assert!(s.is(Status::INVALID_SGL_SEGMENT_DESCRIPTOR));
        assert!(Status::from_raw(0x4011).is(Status::SGL_DESCRIPTOR_TYPE_INVALID));
        assert!(Status::from_raw(0x000e).is(Status::INVALID_NUMBER_OF_SGL_DESCRIPTORS));
        assert!(Status::from_raw(0x0004).is(Status::DATA_TRANSFER_ERROR));
        assert!(Status::from_raw(0x0001).is(Status::INVALID_OPCODE));

        let s = Status::from_raw(0x4101);
        assert_eq!(s.sct(), Sct::CommandSpecific);
        assert!(s.is(Status::INVALID_QUEUE_IDENTIFIER));
        assert_eq!(
            s.to_string(),
            "NVMe status 0x4101 (command specific: Invalid Queue Identifier)"
        );
        assert_eq!(
            Status::from_raw(0x0281).to_string(),
            "NVMe status 0x0281 (media and data integrity: Unrecovered Read Error)"
        );
        assert_eq!(
            Status::from_raw(0x0123).to_string(),
            "NVMe status 0x0123 (command specific: status code 0x23)"
        );
        let s = Status::from_raw(0x3802 | STATUS_MORE);
        assert_eq!((s.crd(), s.more(), s.sc()), (3, true, 0x02));
        assert!(Status::SUCCESS.is_success());
        assert_eq!(
            Status::from_raw(0xffff).raw(),
            0x7fff,
            "bit 15 is not a status bit"
        );
    }

    #[test]
    fn doorbell_offsets() {
        // DSTRD 0: 4-byte doorbells, SQ/CQ interleaved.
        assert_eq!(sq_tail_doorbell(0, 0), 0x1000);
        assert_eq!(cq_head_doorbell(0, 0), 0x1004);
        assert_eq!(sq_tail_doorbell(1, 0), 0x1008);
        assert_eq!(cq_head_doorbell(1, 0), 0x100c);
        assert_eq!(sq_tail_doorbell(64, 0), 0x1200);
        // DSTRD 2: 16-byte stride.
        assert_eq!(sq_tail_doorbell(0, 2), 0x1000);
        assert_eq!(cq_head_doorbell(0, 2), 0x1010);
        assert_eq!(sq_tail_doorbell(1, 2), 0x1020);
        assert_eq!(cq_head_doorbell(1, 2), 0x1030);
        assert_eq!(bar0_len_for_queues(1, 0), 0x1010);
    }

    #[test]
    fn registers_decode_and_encode() {
        // QEMU 7.2-like: MQES 2047, CQR, TO 15 (7.5 s), DSTRD 0, CSS NVM,
        // MPSMIN 0 (4 KiB), MPSMAX 4 (64 KiB).
        let cap = Cap(2047
            | cap::CQR
            | (15 << cap::TO_SHIFT)
            | cap::CSS_NVM
            | (4u64 << cap::MPSMAX_SHIFT));
        assert_eq!(cap.max_queue_entries(), 2048);
        assert!(cap.cqr() && cap.supports_nvm() && !cap.nssrs());
        assert_eq!(cap.timeout_ms(), 7500);
        assert_eq!(cap.dstrd(), 0);
        assert_eq!(cap.css(), 1);
        assert_eq!((cap.mpsmin_bytes(), cap.mpsmax_bytes()), (4096, 65536));
        assert_eq!(Cap(2u64 << cap::DSTRD_SHIFT).dstrd(), 2);

        // nvmetest.c's CC: EN | IOSQES 6 | IOCQES 4, MPS 0.
        let cc = Cc::nvm_enable(0);
        assert_eq!(cc.0, 0x0046_0001);
        assert!(cc.en());
        assert_eq!(
            (
                cc.css(),
                cc.page_bytes(),
                cc.ams(),
                cc.iosqes(),
                cc.iocqes()
            ),
            (0, 4096, 0, 6, 4)
        );
        let shut = cc.with_shn(Shn::Normal);
        assert_eq!(shut.0, 0x0046_4001);
        assert_eq!(shut.shn(), 1);
        assert!(!shut.with_en(false).en());
        assert_eq!(Cc::nvm_enable(4).page_bytes(), 65536);

        assert!(Csts(1).rdy() && !Csts(1).cfs());
        assert!(Csts(2).cfs());
        assert_eq!(Csts(0b1001).shst(), Shst::Complete);
        assert_eq!(Csts(0b0100).shst(), Shst::Occurring);
        assert_eq!(Csts(0).shst(), Shst::Normal);

        assert_eq!(aqa(32, 32), Some((31 << 16) | 31));
        assert_eq!(aqa(4096, 2), Some((1 << 16) | 4095));
        assert_eq!(aqa(1, 32), None);
        assert_eq!(aqa(32, 4097), None);

        let vs = Vs::new(1, 4, 0);
        assert_eq!(vs.0, 0x0001_0400);
        assert_eq!(vs.to_string(), "1.4.0");
    }

    fn put(d: &mut [u8], off: usize, bytes: &[u8]) {
        d[off..off + bytes.len()].copy_from_slice(bytes);
    }

    #[test]
    fn identify_controller_parses_fields() {
        let mut d = [0u8; IDENTIFY_DATA_LEN];
        put(&mut d, idctl::VID, &0x1b36u16.to_le_bytes());
        put(&mut d, idctl::SSVID, &0x1af4u16.to_le_bytes());
        put(&mut d, idctl::SN, b"deadbeef            ");
        put(
            &mut d,
            idctl::MN,
            format!("{:<40}", "QEMU NVMe Ctrl").as_bytes(),
        );
        put(&mut d, idctl::FR, b"7.2.22  ");
        d[idctl::MDTS] = 7;
        put(&mut d, idctl::VER, &0x0001_0400u32.to_le_bytes());
        d[idctl::SQES] = 0x66;
        d[idctl::CQES] = 0x44;
        put(&mut d, idctl::NN, &256u32.to_le_bytes());
        d[idctl::VWC] = 1;
        put(&mut d, idctl::SGLS, &1u32.to_le_bytes());
        let id = IdentifyController::parse(&d);
        assert_eq!((id.vid, id.ssvid), (0x1b36, 0x1af4));
        assert_eq!(id.serial, "deadbeef");
        assert_eq!(id.model, "QEMU NVMe Ctrl");
        assert_eq!(id.firmware, "7.2.22");
        assert_eq!(id.mdts, 7);
        assert_eq!(id.max_transfer_bytes(4096), Some(512 * 1024));
        assert_eq!(id.ver.to_string(), "1.4.0");
        assert_eq!((id.sqe_bytes(), id.cqe_bytes()), (64, 16));
        assert_eq!(id.nn, 256);
        assert!(id.sgl_supported() && !id.sgl_dword_aligned() && !id.sgl_bit_bucket());
        assert!(id.volatile_write_cache());

        put(&mut d, idctl::SGLS, &0u32.to_le_bytes());
        d[idctl::MDTS] = 0;
        let id = IdentifyController::parse(&d);
        assert!(!id.sgl_supported());
        assert_eq!(id.max_transfer_bytes(4096), None);
        put(
            &mut d,
            idctl::SGLS,
            &(2u32 | sgls::BIT_BUCKET).to_le_bytes(),
        );
        let id = IdentifyController::parse(&d);
        assert!(id.sgl_supported() && id.sgl_dword_aligned() && id.sgl_bit_bucket());
        put(&mut d, idctl::SGLS, &3u32.to_le_bytes());
        assert!(
            !IdentifyController::parse(&d).sgl_supported(),
            "11b is reserved"
        );
    }

    #[test]
    fn identify_namespace_parses_lba_format() {
        let mut d = [0u8; IDENTIFY_DATA_LEN];
        put(&mut d, idns::NSZE, &2_097_152u64.to_le_bytes());
        put(&mut d, idns::NCAP, &2_097_152u64.to_le_bytes());
        d[idns::NLBAF] = 1; // two formats
        d[idns::FLBAS] = 1;
        put(&mut d, idns::LBAF, &(9u32 << 16).to_le_bytes());
        put(&mut d, idns::LBAF + 4, &((12u32 << 16) | 8).to_le_bytes());
        let ns = IdentifyNamespace::parse(&d).unwrap();
        assert_eq!(ns.nsze, 2_097_152);
        assert_eq!(ns.lba_format_count, 2);
        assert_eq!(ns.lba_format_index, 1);
        assert_eq!((ns.lba_bytes, ns.metadata_bytes), (4096, 8));
        assert_eq!(ns.size_bytes(), 8 << 30);
        assert!(!ns.extended_lba);

        d[idns::FLBAS] = 0;
        assert_eq!(IdentifyNamespace::parse(&d).unwrap().lba_bytes, 512);
        d[idns::FLBAS] = 2;
        assert_eq!(
            IdentifyNamespace::parse(&d),
            Err(IdentifyError::FormatIndex { index: 2, count: 2 })
        );
        d[idns::FLBAS] = 0;
        put(&mut d, idns::LBAF, &0u32.to_le_bytes());
        let err = IdentifyNamespace::parse(&d).unwrap_err();
        assert_eq!(err, IdentifyError::LbaSize { index: 0, lbads: 0 });
        assert!(err.to_string().contains("LBADS 0"));
    }

    #[test]
    fn sgl_descriptor_kinds() {
        let db = SglDescriptor::data_block(0x1000, 513);
        assert_eq!(db.sgl_type(), Some(SglType::DataBlock));
        let seg = SglDescriptor::segment(0x2000, 3);
        assert_eq!(
            (seg.sgl_id, seg.len, seg.sgl_type()),
            (0x20, 48, Some(SglType::Segment))
        );
        let last = SglDescriptor::last_segment(0x3000, 2);
        assert_eq!((last.sgl_id, last.len), (0x30, 32));
        assert_eq!(last.sgl_type(), Some(SglType::LastSegment));
        let bb = SglDescriptor::bit_bucket(4096);
        assert_eq!((bb.sgl_id, bb.sgl_type()), (0x10, Some(SglType::BitBucket)));
        assert_eq!(last.sgl_subtype(), SGL_SUBTYPE_ADDRESS);
        let bytes: [u8; 16] = bytemuck::cast(last);
        assert_eq!(&bytes[0..8], &0x3000u64.to_le_bytes());
        assert_eq!(&bytes[8..12], &32u32.to_le_bytes());
        assert_eq!(&bytes[12..16], &[0, 0, 0, 0x30]);
        let odd = SglDescriptor { sgl_id: 0x61, ..db };
        assert_eq!((odd.sgl_type(), odd.sgl_subtype()), (None, 1));
        assert_eq!(Dptr::from_sgl(last).sgl1(), last);
    }

    fn aligned(pages: u64) -> Extent {
        Extent {
            addr: 0x10_0000,
            len: pages * PAGE,
        }
    }

    #[test]
    fn prp_one_and_two_pages_need_no_list() {
        let p = build_prps([aligned(1)], PAGE, &mut [], 0).unwrap();
        assert_eq!(
            (p.prp1, p.prp2, p.entries, p.list_slots),
            (0x10_0000, 0, 1, 0)
        );
        let p = build_prps([aligned(2)], PAGE, &mut [], 0).unwrap();
        assert_eq!((p.prp1, p.prp2, p.entries), (0x10_0000, 0x10_1000, 2));
        // 100 bytes inside a page: one entry, with the offset.
        let p = build_prps(
            [Extent {
                addr: 0x10_0f00,
                len: 0x100,
            }],
            PAGE,
            &mut [],
            0,
        )
        .unwrap();
        assert_eq!((p.prp1, p.prp2), (0x10_0f00, 0));
        // One page starting mid-page touches two pages.
        let p = build_prps(
            [Extent {
                addr: 0x10_0800,
                len: PAGE,
            }],
            PAGE,
            &mut [],
            0,
        )
        .unwrap();
        assert_eq!((p.prp1, p.prp2, p.entries), (0x10_0800, 0x10_1000, 2));
        assert_eq!(
            p.data_ptr(),
            DataPtr::Prp {
                prp1: 0x10_0800,
                prp2: 0x10_1000
            }
        );
        assert_eq!(prp_list_pages_needed(PAGE, PAGE), 0);
        assert_eq!(prp_list_pages_needed(2 * PAGE, PAGE), 0);
    }

    #[test]
    fn prp_three_pages_use_a_list() {
        let mut list = vec![0u64; 512];
        let p = build_prps([aligned(3)], PAGE, &mut list, 0x80_0000).unwrap();
        assert_eq!(
            (p.prp1, p.prp2, p.entries, p.list_slots),
            (0x10_0000, 0x80_0000, 3, 2)
        );
        assert_eq!(&list[..2], &[0x10_1000, 0x10_2000]);
        assert_eq!(list[2], 0, "nothing written past the list");
        assert_eq!(prp_list_pages_needed(3 * PAGE, PAGE), 1);
    }

    #[test]
    fn prp_513_pages_fill_one_list_page_514_chain() {
        // 513 pages: PRP1 + 512 list entries, exactly one full list page.
        assert_eq!(prp_list_pages_needed(513 * PAGE, PAGE), 1);
        let mut list = vec![0u64; 1024];
        let p = build_prps([aligned(513)], PAGE, &mut list, 0x80_0000).unwrap();
        assert_eq!((p.entries, p.list_slots), (513, 512));
        for (i, e) in list[..512].iter().enumerate() {
            assert_eq!(*e, 0x10_0000 + (i as u64 + 1) * PAGE);
        }
        assert_eq!(list[512], 0);
        // A list of exactly one page is enough for 513 pages.
        let mut one = vec![0u64; 512];
        build_prps([aligned(513)], PAGE, &mut one, 0x80_0000).unwrap();

        // 514 pages: 513 list entries; slot 511 chains to the second page.
        assert_eq!(prp_list_pages_needed(514 * PAGE, PAGE), 2);
        let mut list = vec![0u64; 1024];
        let p = build_prps([aligned(514)], PAGE, &mut list, 0x80_0000).unwrap();
        assert_eq!((p.entries, p.list_slots), (514, 514));
        assert_eq!(list[510], 0x10_0000 + 511 * PAGE);
        assert_eq!(list[511], 0x80_1000, "chain pointer to the next list page");
        assert_eq!(list[512], 0x10_0000 + 512 * PAGE);
        assert_eq!(list[513], 0x10_0000 + 513 * PAGE);
        let err = build_prps([aligned(514)], PAGE, &mut one, 0x80_0000).unwrap_err();
        assert_eq!(
            err,
            PrpError::ListTooSmall {
                entries: 513,
                pages: 2,
                page: PAGE,
                have: 512
            }
        );
        // Page counts: 511 usable entries per chained page.
        assert_eq!(prp_list_pages_for_entries(1 + 511 + 512, PAGE), 2);
        assert_eq!(prp_list_pages_for_entries(1 + 511 + 513, PAGE), 3);
    }

    #[test]
    fn prp_scattered_page_aligned_extents() {
        let extents = [
            Extent {
                addr: 0x10_0800,
                len: 0x800,
            },
            Extent {
                addr: 0x20_0000,
                len: 2 * PAGE,
            },
            Extent {
                addr: 0x30_0000,
                len: 100,
            },
        ];
        assert_eq!(prp_entry_count(extents, PAGE), Ok(4));
        let mut list = vec![0u64; 512];
        let p = build_prps(extents, PAGE, &mut list, 0x80_0000).unwrap();
        assert_eq!(p.prp1, 0x10_0800);
        assert_eq!(&list[..3], &[0x20_0000, 0x20_1000, 0x30_0000]);
        // SGL descriptors (the P2P table's type) convert.
        let descs = [SglDescriptor::data_block(0x20_0000, 4096)];
        assert_eq!(prp_entry_count(descs.iter(), PAGE), Ok(1));
    }

    #[test]
    fn prp_rejects_unaligned_middles() {
        let mid_start = [
            aligned(1),
            Extent {
                addr: 0x20_0010,
                len: PAGE,
            },
        ];
        assert_eq!(
            prp_entry_count(mid_start, PAGE),
            Err(PrpError::UnalignedStart {
                index: 1,
                addr: 0x20_0010,
                page: PAGE
            })
        );
        let mid_end = [
            Extent {
                addr: 0x10_0000,
                len: 1000,
            },
            Extent {
                addr: 0x20_0000,
                len: PAGE,
            },
        ];
        let err = prp_entry_count(mid_end, PAGE).unwrap_err();
        assert_eq!(
            err,
            PrpError::UnalignedEnd {
                index: 0,
                end: 0x10_03e8,
                page: PAGE
            }
        );
        assert!(err.to_string().contains("use an SGL"));
        assert_eq!(
            prp_entry_count(
                [Extent {
                    addr: 0x10_0002,
                    len: 8
                }],
                PAGE
            ),
            Err(PrpError::UnalignedFirst { addr: 0x10_0002 })
        );
        assert_eq!(
            prp_entry_count(Vec::<Extent>::new(), PAGE),
            Err(PrpError::Empty)
        );
        assert_eq!(
            prp_entry_count(
                [
                    aligned(1),
                    Extent {
                        addr: 0x20_0000,
                        len: 0
                    }
                ],
                PAGE
            ),
            Err(PrpError::EmptyExtent { index: 1 })
        );
        assert_eq!(
            prp_entry_count([aligned(1)], 1000),
            Err(PrpError::PageSize(1000))
        );
        assert!(matches!(
            prp_entry_count(
                [Extent {
                    addr: u64::MAX - 3,
                    len: 8
                }],
                PAGE
            ),
            Err(PrpError::Overflow { .. })
        ));
        let mut list = vec![0u64; 512];
        assert_eq!(
            build_prps([aligned(3)], PAGE, &mut list, 0x80_0008),
            Err(PrpError::ListUnaligned {
                addr: 0x80_0008,
                page: PAGE
            })
        );
    }

    #[test]
    fn prp_with_larger_pages() {
        let page = 65536;
        let ext = Extent {
            addr: 0x100_0000,
            len: 3 * page,
        };
        let mut list = vec![0u64; 8192];
        let p = build_prps([ext], page, &mut list, 0x200_0000).unwrap();
        assert_eq!(p.entries, 3);
        assert_eq!(&list[..2], &[0x101_0000, 0x102_0000]);
        assert_eq!(prp_list_pages_needed(8193 * page, page), 1);
        assert_eq!(prp_list_pages_needed(8194 * page, page), 2);
    }

    #[test]
    fn constants_are_unique_and_named() {
        let c = nvme_constants();
        let mut names: Vec<&str> = c.iter().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len(), "duplicate constant names");
        assert!(names.iter().all(|n| n.starts_with("KVTIER_NVME_")));
        assert!(nvme_layouts()
            .iter()
            .all(|(t, _, _)| t.starts_with("kvtier_nvme_")));
    }
}
