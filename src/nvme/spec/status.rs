//! NVMe status: status code types, the status field and its names.

use std::fmt;

/// Status Code Type (the SCT field).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Sct {
    /// Generic command status.
    Generic,
    /// Command specific status.
    CommandSpecific,
    /// Media and data integrity errors.
    MediaAndDataIntegrity,
    /// Path related status.
    Path,
    /// Vendor specific.
    VendorSpecific,
    /// A reserved type.
    Reserved(u8),
}

impl Sct {
    /// The type of these 3 bits.
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

    /// Its 3 bits.
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

    /// Its name in messages.
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
/// Shift of the status code type.
pub const STATUS_SCT_SHIFT: u16 = 8;
/// Status code type bits.
pub const STATUS_SCT_MASK: u16 = 0x7 << STATUS_SCT_SHIFT;
/// Shift of the command retry delay.
pub const STATUS_CRD_SHIFT: u16 = 11;
/// Command retry delay bits.
pub const STATUS_CRD_MASK: u16 = 0x3 << STATUS_CRD_SHIFT;
/// More: a log page has more about it.
pub const STATUS_MORE: u16 = 1 << 13;
/// Do not retry.
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
    /// Generic status 0x00: success.
    pub const SUCCESS: Status = Status::generic(0x00);
    /// Generic status 0x01: invalid opcode.
    pub const INVALID_OPCODE: Status = Status::generic(0x01);
    /// Generic status 0x02: invalid field.
    pub const INVALID_FIELD: Status = Status::generic(0x02);
    /// Generic status 0x03: command id conflict.
    pub const COMMAND_ID_CONFLICT: Status = Status::generic(0x03);
    /// Generic status 0x04: data transfer error.
    pub const DATA_TRANSFER_ERROR: Status = Status::generic(0x04);
    /// Generic status 0x05: aborted power loss.
    pub const ABORTED_POWER_LOSS: Status = Status::generic(0x05);
    /// Generic status 0x06: internal error.
    pub const INTERNAL_ERROR: Status = Status::generic(0x06);
    /// Generic status 0x07: abort requested.
    pub const ABORT_REQUESTED: Status = Status::generic(0x07);
    /// Generic status 0x08: aborted SQ deletion.
    pub const ABORTED_SQ_DELETION: Status = Status::generic(0x08);
    /// Generic status 0x0b: invalid namespace or format.
    pub const INVALID_NAMESPACE_OR_FORMAT: Status = Status::generic(0x0b);
    /// Generic status 0x0c: command sequence error.
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::generic(0x0c);
    /// Generic status 0x0d: invalid SGL segment descriptor.
    pub const INVALID_SGL_SEGMENT_DESCRIPTOR: Status = Status::generic(0x0d);
    /// Generic status 0x0e: invalid number of SGL descriptors.
    pub const INVALID_NUMBER_OF_SGL_DESCRIPTORS: Status = Status::generic(0x0e);
    /// Generic status 0x0f: data SGL length invalid.
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::generic(0x0f);
    /// Generic status 0x10: metadata SGL length invalid.
    pub const METADATA_SGL_LENGTH_INVALID: Status = Status::generic(0x10);
    /// Generic status 0x11: SGL descriptor type invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::generic(0x11);
    /// Generic status 0x13: PRP offset invalid.
    pub const PRP_OFFSET_INVALID: Status = Status::generic(0x13);
    /// Generic status 0x16: SGL offset invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::generic(0x16);
    /// Generic status 0x80: LBA out of range.
    pub const LBA_OUT_OF_RANGE: Status = Status::generic(0x80);
    /// Generic status 0x81: capacity exceeded.
    pub const CAPACITY_EXCEEDED: Status = Status::generic(0x81);
    /// Generic status 0x82: namespace not ready.
    pub const NAMESPACE_NOT_READY: Status = Status::generic(0x82);

    /// Command specific status 0x00: completion queue invalid.
    pub const COMPLETION_QUEUE_INVALID: Status = Status::command_specific(0x00);
    /// Command specific status 0x01: invalid queue identifier.
    pub const INVALID_QUEUE_IDENTIFIER: Status = Status::command_specific(0x01);
    /// Command specific status 0x02: invalid queue size.
    pub const INVALID_QUEUE_SIZE: Status = Status::command_specific(0x02);
    /// Command specific status 0x08: invalid interrupt vector.
    pub const INVALID_INTERRUPT_VECTOR: Status = Status::command_specific(0x08);
    /// Command specific status 0x0c: invalid queue deletion.
    pub const INVALID_QUEUE_DELETION: Status = Status::command_specific(0x0c);

    /// Media and data integrity status 0x80: write fault.
    pub const WRITE_FAULT: Status = Status::media(0x80);
    /// Media and data integrity status 0x81: unrecovered read error.
    pub const UNRECOVERED_READ_ERROR: Status = Status::media(0x81);

    /// From a value in the [`Status::raw`] encoding (bit 15 is ignored).
    pub const fn from_raw(raw: u16) -> Status {
        Status(raw & 0x7fff)
    }

    /// From the CQE's status field, phase tag in bit 0.
    pub const fn from_cqe_field(field: u16) -> Status {
        Status(field >> 1)
    }

    /// Status `sc` of type `sct`.
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

    /// Status code.
    pub const fn sc(self) -> u8 {
        (self.0 & STATUS_SC_MASK) as u8
    }

    /// Status code type.
    pub const fn sct(self) -> Sct {
        Sct::from_bits(((self.0 & STATUS_SCT_MASK) >> STATUS_SCT_SHIFT) as u8)
    }

    /// Command Retry Delay: index into the controller's CRDT table.
    pub const fn crd(self) -> u8 {
        ((self.0 & STATUS_CRD_MASK) >> STATUS_CRD_SHIFT) as u8
    }

    /// The More bit.
    pub const fn more(self) -> bool {
        self.0 & STATUS_MORE != 0
    }

    /// The Do Not Retry bit.
    pub const fn dnr(self) -> bool {
        self.0 & STATUS_DNR != 0
    }

    /// Generic status 0: success.
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
