//! The gio_uring binary interface: IOCTX, IOCB and the SGL data-block descriptor.
//!
//! These layouts are consumed by three parties: the host runtime (which fills
//! IOCBs), the io_uring and VFIO-NVMe engines (host code), and the CUDA I/O
//! kernels (which read IOCBs out of GPU-visible memory and turn each IOCTX into
//! NVMe commands). The C side is `kernels/kvtier_abi.h`; both sides assert every
//! size and offset, and `tests/abi_header.rs` compiles the header's
//! `static_assert`s so a drift on either side fails the build.
//!
//! Ownership of fields follows io_uring: the submitter writes the request
//! fields before `submit`; the engine writes only `status`/`result` of each
//! IOCTX and `done`/`errors` of the IOCB header; the submitter reads them only
//! after the IOCB id has come back through the completion queue.

use bytemuck::{Pod, Zeroable};
use std::mem::{offset_of, size_of};

/// IOCTXs per IOCB: one per thread of a 2-SM scheduling unit on Hopper
/// (2 SMs x 64 warps x 32 threads), so a GPU engine gives each IOCTX a thread.
pub const IOCB_MAX_IOCTX: usize = 2048;

/// Memory segments per IOCB. A segment is one P2P-table index (one KV object,
/// or one staging buffer), so a coalesced IOCTX covering a run of G blocks of
/// one layer uses 2G segments. 16384 covers one full layer of a 128K-token
/// llama3-8b prefix at block size 16 in one IOCB (8192 blocks x K|V).
pub const IOCB_MAX_SEGS: usize = 16384;

/// IOCTX opcodes are NVMe NVM command set opcodes so the GPU kernel copies them
/// into the SQE unchanged.
pub const IOCTX_OP_FLUSH: u8 = 0x00;
/// Write (NVM opcode 01h).
pub const IOCTX_OP_WRITE: u8 = 0x01;
/// Read (NVM opcode 02h).
pub const IOCTX_OP_READ: u8 = 0x02;

/// `IoCtx::status` values. 0 is success. Values below 0x0800 are NVMe status
/// fields (SCT << 8 | SC) reported by an NVMe engine; the values here are for
/// failures an NVMe status cannot express.
pub const IOCTX_STATUS_OK: u16 = 0;
/// The OS failed the I/O; `result` holds the errno (io_uring engine).
pub const IOCTX_STATUS_ERRNO: u16 = 0x8000;
/// The device transferred fewer bytes than asked; `result` holds how many.
pub const IOCTX_STATUS_SHORT: u16 = 0x8001;
/// The IOCTX itself is malformed (bad device index, segment range, length
/// that disagrees with its segments); `result` is 0.
pub const IOCTX_STATUS_INVALID: u16 = 0x8002;
/// The device did not complete the I/O in time: the nvme engine's I/O
/// timeout (it then stops the controller, so the I/O can no longer land) or
/// the GPU engine's per-batch poll budget. `result` holds the bytes of the
/// IOCTX's commands that did complete (GPU engine) or 0 (nvme engine).
pub const IOCTX_STATUS_TIMEOUT: u16 = 0x8003;

/// One I/O: a device extent and the memory it moves to or from.
///
/// Memory is named indirectly, by a range of P2P-table indices kept in the
/// IOCB's segment array, never by raw address: the table is built once at
/// registration (host addresses now, GPU/IOVA addresses for the GPU and NVMe
/// engines), so the per-I/O work is a table lookup, and a 16-byte SGL
/// data-block descriptor per segment is all the NVMe command needs.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IoCtx {
    /// Byte offset on the device; a multiple of the device's direct-I/O
    /// alignment (4096). Ignored for FLUSH.
    pub dev_offset: u64,
    /// Bytes to move; equals the sum of the segments' lengths. 0 for FLUSH.
    pub len: u32,
    /// First entry of this IOCTX's segments in `Iocb::segs`.
    pub seg_first: u32,
    /// Number of segments; memory is the concatenation of their extents in order.
    pub seg_count: u16,
    /// Device index within the pool (0-based).
    pub dev: u16,
    /// `IOCTX_OP_*`.
    pub op: u8,
    /// Reserved for future use (FUA, priority); must be 0.
    pub flags: u8,
    /// Written by the engine at completion: `IOCTX_STATUS_*` or an NVMe status.
    pub status: u16,
    /// Written by the engine at completion: bytes moved on success, errno for
    /// `IOCTX_STATUS_ERRNO`, bytes moved for `IOCTX_STATUS_SHORT`.
    pub result: u32,
    /// The submitter's own tag (the tier stores a run index); engines never read it.
    pub tag: u32,
}

/// `IocbHeader::state` values.
pub(crate) const IOCB_STATE_FREE: u32 = 0;
/// Handed out by `get_iocb`, being filled by the submitter.
pub const IOCB_STATE_FILLING: u32 = 1;
/// In the submission queue or being executed by the engine.
pub(crate) const IOCB_STATE_SUBMITTED: u32 = 2;
/// Every IOCTX has completed; its id is (or was) in the completion queue.
pub const IOCB_STATE_COMPLETE: u32 = 3;

/// The fixed part of an IOCB: identity, counts, state and completion tallies.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Pod, Zeroable)]
pub struct IocbHeader {
    /// The IOCB's index in the ring's arena; set once, never changes.
    pub id: u32,
    /// IOCTXs in use: `ctx[..count]`.
    pub count: u32,
    /// Segments in use: `segs[..seg_count]`.
    pub seg_count: u32,
    /// `IOCB_STATE_*`.
    pub state: u32,
    /// IOCTXs completed so far (engine-owned while SUBMITTED).
    pub done: u32,
    /// IOCTXs completed with a non-zero status (engine-owned while SUBMITTED).
    pub errors: u32,
    /// The submitter's cookie, returned untouched (the tier stores a job/phase id).
    pub user_data: u64,
}

/// A batch of up to 2048 IOCTXs, completed as one.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub struct Iocb {
    /// Identity, counts, state.
    pub hdr: IocbHeader,
    /// The IOCTXs; the first `hdr.count` are in use.
    pub ctx: [IoCtx; IOCB_MAX_IOCTX],
    /// P2P-table indices referenced by the IOCTXs' segment ranges.
    pub segs: [u32; IOCB_MAX_SEGS],
}

/// The NVMe SGL Data Block descriptor is the spec's (owned by [`crate::nvme::spec`]);
/// the P2P table and the IOCB segments carry it unchanged, so the ABI re-exports it.
pub use crate::nvme::spec::{SglDescriptor, SGL_ID_DATA_BLOCK};

// Layout asserts: the C header asserts the same numbers (kernels/kvtier_abi.h).
const _: () = {
    // IOCTX opcodes are NVM opcodes: an NVMe engine copies `IoCtx::op` unchanged.
    assert!(IOCTX_OP_READ == crate::nvme::spec::nvm_opc::READ);
    assert!(IOCTX_OP_WRITE == crate::nvme::spec::nvm_opc::WRITE);
    assert!(IOCTX_OP_FLUSH == crate::nvme::spec::nvm_opc::FLUSH);

    assert!(size_of::<IoCtx>() == 32);
    assert!(offset_of!(IoCtx, dev_offset) == 0);
    assert!(offset_of!(IoCtx, len) == 8);
    assert!(offset_of!(IoCtx, seg_first) == 12);
    assert!(offset_of!(IoCtx, seg_count) == 16);
    assert!(offset_of!(IoCtx, dev) == 18);
    assert!(offset_of!(IoCtx, op) == 20);
    assert!(offset_of!(IoCtx, flags) == 21);
    assert!(offset_of!(IoCtx, status) == 22);
    assert!(offset_of!(IoCtx, result) == 24);
    assert!(offset_of!(IoCtx, tag) == 28);

    assert!(size_of::<IocbHeader>() == 32);
    assert!(offset_of!(IocbHeader, id) == 0);
    assert!(offset_of!(IocbHeader, count) == 4);
    assert!(offset_of!(IocbHeader, seg_count) == 8);
    assert!(offset_of!(IocbHeader, state) == 12);
    assert!(offset_of!(IocbHeader, done) == 16);
    assert!(offset_of!(IocbHeader, errors) == 20);
    assert!(offset_of!(IocbHeader, user_data) == 24);

    assert!(offset_of!(Iocb, hdr) == 0);
    assert!(offset_of!(Iocb, ctx) == 32);
    assert!(offset_of!(Iocb, segs) == 32 + 32 * IOCB_MAX_IOCTX);
    assert!(size_of::<Iocb>() == 32 + 32 * IOCB_MAX_IOCTX + 4 * IOCB_MAX_SEGS);

    assert!(size_of::<SglDescriptor>() == 16);
    assert!(offset_of!(SglDescriptor, addr) == 0);
    assert!(offset_of!(SglDescriptor, len) == 8);
    assert!(offset_of!(SglDescriptor, reserved) == 12);
    assert!(offset_of!(SglDescriptor, sgl_id) == 15);
};

/// The numbers the C header must agree with, for the header test.
pub fn abi_constants() -> Vec<(&'static str, u64)> {
    vec![
        ("KVTIER_IOCB_MAX_IOCTX", IOCB_MAX_IOCTX as u64),
        ("KVTIER_IOCB_MAX_SEGS", IOCB_MAX_SEGS as u64),
        ("KVTIER_IOCTX_SIZE", size_of::<IoCtx>() as u64),
        ("KVTIER_IOCB_HEADER_SIZE", size_of::<IocbHeader>() as u64),
        ("KVTIER_IOCB_SIZE", size_of::<Iocb>() as u64),
        ("KVTIER_SGL_DESC_SIZE", size_of::<SglDescriptor>() as u64),
        ("KVTIER_IOCTX_OP_FLUSH", IOCTX_OP_FLUSH as u64),
        ("KVTIER_IOCTX_OP_WRITE", IOCTX_OP_WRITE as u64),
        ("KVTIER_IOCTX_OP_READ", IOCTX_OP_READ as u64),
        ("KVTIER_IOCTX_STATUS_ERRNO", IOCTX_STATUS_ERRNO as u64),
        ("KVTIER_IOCTX_STATUS_SHORT", IOCTX_STATUS_SHORT as u64),
        ("KVTIER_IOCTX_STATUS_INVALID", IOCTX_STATUS_INVALID as u64),
        ("KVTIER_IOCTX_STATUS_TIMEOUT", IOCTX_STATUS_TIMEOUT as u64),
        ("KVTIER_IOCB_STATE_FREE", IOCB_STATE_FREE as u64),
        ("KVTIER_IOCB_STATE_FILLING", IOCB_STATE_FILLING as u64),
        ("KVTIER_IOCB_STATE_SUBMITTED", IOCB_STATE_SUBMITTED as u64),
        ("KVTIER_IOCB_STATE_COMPLETE", IOCB_STATE_COMPLETE as u64),
    ]
}
