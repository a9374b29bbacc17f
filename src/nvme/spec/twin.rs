//! Layout asserts and the numbers the C/CUDA twin (kernels/nvme_spec.h) is checked against.

use super::*;
use std::mem::{offset_of, size_of};

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
