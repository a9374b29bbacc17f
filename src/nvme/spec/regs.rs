//! Controller registers (BAR0): offsets, CAP, VS, CC, CSTS.

use std::fmt;

/// Offsets of the controller registers in BAR0.
pub mod reg {
    /// Controller Capabilities (64-bit).
    pub const CAP: usize = 0x00;
    /// Version (32-bit).
    pub const VS: usize = 0x08;
    /// Interrupt Mask Set / Clear (32-bit).
    pub const INTMS: usize = 0x0c;
    /// Interrupt mask clear.
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
    /// Admin completion queue base address.
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
    /// Maximum queue entries supported (0-based).
    pub const MQES_MASK: u64 = 0xffff;
    /// Contiguous queues required.
    pub const CQR: u64 = 1 << 16;
    /// Shift of arbitration mechanisms supported.
    pub const AMS_SHIFT: u32 = 17;
    /// Shift of the timeout (500 ms units).
    pub const TO_SHIFT: u32 = 24;
    /// Shift of the doorbell stride.
    pub const DSTRD_SHIFT: u32 = 32;
    /// NVM subsystem reset supported.
    pub const NSSRS: u64 = 1 << 36;
    /// Shift of the command sets supported.
    pub const CSS_SHIFT: u32 = 37;
    /// CAP.CSS bit 0: the NVM command set.
    pub const CSS_NVM: u64 = 1 << 37;
    /// Shift of the minimum memory page size.
    pub const MPSMIN_SHIFT: u32 = 48;
    /// Shift of the maximum memory page size.
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

    /// NVM subsystem reset supported.
    pub const fn nssrs(self) -> bool {
        self.0 & cap::NSSRS != 0
    }

    /// Command Sets Supported (CAP.CSS, 8 bits).
    pub const fn css(self) -> u8 {
        ((self.0 >> cap::CSS_SHIFT) & 0xff) as u8
    }

    /// The NVM command set is supported.
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
    /// Version `major.minor.tertiary`.
    pub const fn new(major: u16, minor: u8, tertiary: u8) -> Vs {
        Vs(((major as u32) << 16) | ((minor as u32) << 8) | tertiary as u32)
    }
    /// Major version.
    pub const fn major(self) -> u16 {
        (self.0 >> 16) as u16
    }
    /// Minor version.
    pub const fn minor(self) -> u8 {
        (self.0 >> 8) as u8
    }
    /// Tertiary version.
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
    /// Enable.
    pub const EN: u32 = 1 << 0;
    /// Shift of the I/O command set selected.
    pub const CSS_SHIFT: u32 = 4;
    /// Shift of the memory page size.
    pub const MPS_SHIFT: u32 = 7;
    /// Shift of the arbitration mechanism.
    pub const AMS_SHIFT: u32 = 11;
    /// Shift of the shutdown notification.
    pub const SHN_SHIFT: u32 = 14;
    /// Shutdown notification bits.
    pub const SHN_MASK: u32 = 0x3 << SHN_SHIFT;
    /// Shift of the I/O SQ entry size.
    pub const IOSQES_SHIFT: u32 = 16;
    /// Shift of the I/O CQ entry size.
    pub const IOCQES_SHIFT: u32 = 20;
    /// CC.CSS value for the NVM command set.
    pub const CSS_NVM: u32 = 0;
    /// log2 of the SQE and CQE sizes, for IOSQES / IOCQES.
    pub const IOSQES_64B: u32 = 6;
    /// 16-byte CQ entries (log2).
    pub const IOCQES_16B: u32 = 4;
}

/// Shutdown Notification (CC.SHN).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Shn {
    /// No shutdown requested.
    None = 0,
    /// Normal shutdown.
    Normal = 1,
    /// Abrupt shutdown.
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

    /// CC.EN.
    pub const fn en(self) -> bool {
        self.0 & cc::EN != 0
    }
    /// With CC.EN set to `en`.
    pub const fn with_en(self, en: bool) -> Cc {
        Cc(if en {
            self.0 | cc::EN
        } else {
            self.0 & !cc::EN
        })
    }
    /// CC.CSS (I/O command set).
    pub const fn css(self) -> u8 {
        ((self.0 >> cc::CSS_SHIFT) & 0x7) as u8
    }
    /// The memory page size selected, in bytes.
    pub const fn page_bytes(self) -> u64 {
        1 << (12 + ((self.0 >> cc::MPS_SHIFT) & 0xf))
    }
    /// CC.AMS (arbitration).
    pub const fn ams(self) -> u8 {
        ((self.0 >> cc::AMS_SHIFT) & 0x7) as u8
    }
    /// CC.SHN (shutdown notification).
    pub const fn shn(self) -> u8 {
        ((self.0 & cc::SHN_MASK) >> cc::SHN_SHIFT) as u8
    }
    /// With CC.SHN set to `shn`.
    pub const fn with_shn(self, shn: Shn) -> Cc {
        Cc((self.0 & !cc::SHN_MASK) | ((shn as u32) << cc::SHN_SHIFT))
    }
    /// CC.IOSQES (log2 of the SQ entry size).
    pub const fn iosqes(self) -> u8 {
        ((self.0 >> cc::IOSQES_SHIFT) & 0xf) as u8
    }
    /// CC.IOCQES (log2 of the CQ entry size).
    pub const fn iocqes(self) -> u8 {
        ((self.0 >> cc::IOCQES_SHIFT) & 0xf) as u8
    }
}

/// CSTS bit positions.
pub mod csts {
    /// Ready.
    pub const RDY: u32 = 1 << 0;
    /// Controller fatal status.
    pub const CFS: u32 = 1 << 1;
    /// Shift of the shutdown status.
    pub const SHST_SHIFT: u32 = 2;
    /// Shutdown status bits.
    pub const SHST_MASK: u32 = 0x3 << SHST_SHIFT;
    /// NVM subsystem reset occurred.
    pub const NSSRO: u32 = 1 << 4;
    /// Processing paused.
    pub const PP: u32 = 1 << 5;
}

/// Shutdown Status (CSTS.SHST).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shst {
    /// Normal operation.
    Normal,
    /// Shutdown processing.
    Occurring,
    /// Shutdown complete.
    Complete,
    /// Reserved.
    Reserved,
}

/// Controller Status.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Csts(pub u32);

impl Csts {
    /// CSTS.RDY.
    pub const fn rdy(self) -> bool {
        self.0 & csts::RDY != 0
    }
    /// Controller Fatal Status: the controller needs a reset.
    pub const fn cfs(self) -> bool {
        self.0 & csts::CFS != 0
    }
    /// CSTS.SHST.
    pub const fn shst(self) -> Shst {
        match (self.0 & csts::SHST_MASK) >> csts::SHST_SHIFT {
            0 => Shst::Normal,
            1 => Shst::Occurring,
            2 => Shst::Complete,
            _ => Shst::Reserved,
        }
    }
    /// CSTS.NSSRO (NVM subsystem reset occurred).
    pub const fn nssro(self) -> bool {
        self.0 & csts::NSSRO != 0
    }
    /// CSTS.PP (processing paused).
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
