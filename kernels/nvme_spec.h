/*
 * nvme_spec.h: NVMe specification layouts, C/CUDA side.
 *
 * The twin of src/nvme/spec.rs: the submission and completion queue entries,
 * the data pointer (PRP entries or SGL Descriptor 1), SGL descriptor types,
 * status field bits, controller register offsets and bits, and the byte
 * offsets of the Identify fields kvtier reads. The GPU I/O kernels build SQEs
 * and parse CQEs with these definitions in the same rings the host driver
 * sets up, so both sides assert every size and offset, and
 * tests/nvme_header.rs compiles this header (as C11, C++17 and, where nvcc is
 * found, CUDA) with static_asserts generated from
 * kvtier::nvme::spec::{nvme_constants, nvme_layouts}.
 *
 * Numbers are the NVM Express Base Specification's (PCIe transport). All
 * fields are little-endian; the structs are meant to be read and written with
 * native loads and stores on little-endian hosts and GPUs.
 *
 * The SGL descriptor type is kvtier_sgl_desc from kvtier_abi.h: the P2P
 * table's 16-byte Data Block descriptor is the spec's SGL descriptor, so a
 * kernel copies table entries into SGL segments (or DPTR) unchanged.
 *
 * Rules for editing: change spec.rs and this file together; keep the structs
 * free of implicit padding. Needs only <stdint.h>, <stddef.h>, <assert.h>
 * (through kvtier_abi.h).
 */
#ifndef KVTIER_NVME_SPEC_H
#define KVTIER_NVME_SPEC_H

#include "kvtier_abi.h" /* kvtier_sgl_desc, static_assert in C11 */

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- sizes -- */

#define KVTIER_NVME_SQE_SIZE 64
#define KVTIER_NVME_CQE_SIZE 16
#define KVTIER_NVME_SGL_DESC_SIZE 16
#define KVTIER_NVME_IDENTIFY_DATA_LEN 4096

/* -------------------------------------------------------------- opcodes -- */

/* Admin command set (queue 0). */
#define KVTIER_NVME_ADMIN_DELETE_IO_SQ 0x00
#define KVTIER_NVME_ADMIN_CREATE_IO_SQ 0x01
#define KVTIER_NVME_ADMIN_GET_LOG_PAGE 0x02
#define KVTIER_NVME_ADMIN_DELETE_IO_CQ 0x04
#define KVTIER_NVME_ADMIN_CREATE_IO_CQ 0x05
#define KVTIER_NVME_ADMIN_IDENTIFY 0x06
#define KVTIER_NVME_ADMIN_ABORT 0x08
#define KVTIER_NVME_ADMIN_SET_FEATURES 0x09
#define KVTIER_NVME_ADMIN_GET_FEATURES 0x0a

/* NVM command set (I/O queues); equal to KVTIER_IOCTX_OP_*. */
#define KVTIER_NVME_OPC_FLUSH 0x00
#define KVTIER_NVME_OPC_WRITE 0x01
#define KVTIER_NVME_OPC_READ 0x02

/* Identify CNS (CDW10 bits 7:0). */
#define KVTIER_NVME_CNS_NAMESPACE 0x00
#define KVTIER_NVME_CNS_CONTROLLER 0x01
#define KVTIER_NVME_CNS_ACTIVE_NAMESPACES 0x02

/* Set/Get Features identifiers (CDW10 bits 7:0). */
#define KVTIER_NVME_FEAT_NUMBER_OF_QUEUES 0x07

/* ------------------------------------------------------------ SQE flags -- */

/* SQE byte 1 (CDW0 bits 15:8): FUSE in bits 1:0, PSDT in bits 7:6. */
#define KVTIER_NVME_SQE_FLAGS_FUSE_MASK 0x03
#define KVTIER_NVME_SQE_FLAGS_PSDT_SHIFT 6
#define KVTIER_NVME_SQE_FLAGS_PSDT_MASK 0xc0

#define KVTIER_NVME_FUSE_NORMAL 0
#define KVTIER_NVME_FUSE_FIRST 1
#define KVTIER_NVME_FUSE_SECOND 2

/* PRP or SGL for Data Transfer. Admin commands on PCIe use PRP only. */
#define KVTIER_NVME_PSDT_PRP 0
/* SGL for data; MPTR is one contiguous metadata buffer (what kvtier uses). */
#define KVTIER_NVME_PSDT_SGL_MPTR_CONTIG 1
/* SGL for data; MPTR is an SGL segment for metadata. */
#define KVTIER_NVME_PSDT_SGL_MPTR_SGL 2
/* Reserved: QEMU answers Invalid Field in Command (status 0x4002). */
#define KVTIER_NVME_PSDT_RESERVED 3

/* ------------------------------------------------------------------ SGL -- */

/* Descriptor type: identifier byte high nibble. */
#define KVTIER_NVME_SGL_TYPE_DATA_BLOCK 0x0
#define KVTIER_NVME_SGL_TYPE_BIT_BUCKET 0x1
#define KVTIER_NVME_SGL_TYPE_SEGMENT 0x2
#define KVTIER_NVME_SGL_TYPE_LAST_SEGMENT 0x3
/* Descriptor subtype: identifier byte low nibble. */
#define KVTIER_NVME_SGL_SUBTYPE_ADDRESS 0x0

/* Identifier bytes (type << 4 | subtype). A Segment / Last Segment
 * descriptor's len is the byte length of the segment it points at (16 per
 * descriptor). Inside a segment QEMU accepts only Data Blocks plus one
 * trailing Segment or Last Segment descriptor. */
#define KVTIER_NVME_SGL_ID_DATA_BLOCK 0x00
#define KVTIER_NVME_SGL_ID_BIT_BUCKET 0x10
#define KVTIER_NVME_SGL_ID_SEGMENT 0x20
#define KVTIER_NVME_SGL_ID_LAST_SEGMENT 0x30

/* --------------------------------------------------------------- status -- */

/*
 * The CQE status field: bit 0 phase tag, bits 8:1 SC, 11:9 SCT, 13:12 CRD,
 * 14 More, 15 DNR. KVTIER_NVME_CQE_STATUS() shifts the phase tag out, giving
 * the value QEMU and Linux print (0x400f = DNR + generic SC 0x0f); the masks
 * below apply to that shifted value. Status codes (SCT << 8 | SC) are below
 * 0x0800, as kvtier_ioctx.status requires.
 */
#define KVTIER_NVME_CQE_STATUS_PHASE 0x0001
#define KVTIER_NVME_CQE_STATUS(field) ((uint16_t)((uint16_t)(field) >> 1))
#define KVTIER_NVME_STATUS_SC_MASK 0x00ff
#define KVTIER_NVME_STATUS_SCT_SHIFT 8
#define KVTIER_NVME_STATUS_SCT_MASK 0x0700
#define KVTIER_NVME_STATUS_CRD_SHIFT 11
#define KVTIER_NVME_STATUS_CRD_MASK 0x1800
#define KVTIER_NVME_STATUS_MORE 0x2000
#define KVTIER_NVME_STATUS_DNR 0x4000
/* SCT << 8 | SC of a shifted status: what an engine stores in an IOCTX. */
#define KVTIER_NVME_STATUS_CODE(status) \
    ((uint16_t)((status) & (KVTIER_NVME_STATUS_SCT_MASK | KVTIER_NVME_STATUS_SC_MASK)))

/* A few status codes (SCT << 8 | SC) the kernels check for. */
#define KVTIER_NVME_STATUS_INVALID_FIELD 0x0002
#define KVTIER_NVME_STATUS_DATA_SGL_LENGTH_INVALID 0x000f
#define KVTIER_NVME_STATUS_LBA_OUT_OF_RANGE 0x0080

/* ------------------------------------------------------------ registers -- */

/* BAR0 offsets. */
#define KVTIER_NVME_REG_CAP 0x00 /* 64-bit */
#define KVTIER_NVME_REG_VS 0x08
#define KVTIER_NVME_REG_INTMS 0x0c
#define KVTIER_NVME_REG_INTMC 0x10
#define KVTIER_NVME_REG_CC 0x14
#define KVTIER_NVME_REG_CSTS 0x1c
#define KVTIER_NVME_REG_NSSR 0x20
#define KVTIER_NVME_REG_AQA 0x24
#define KVTIER_NVME_REG_ASQ 0x28 /* 64-bit */
#define KVTIER_NVME_REG_ACQ 0x30 /* 64-bit */
#define KVTIER_NVME_REG_DOORBELL_BASE 0x1000

/* Doorbells, 4 << CAP.DSTRD bytes apart: SQ y tail at 2y, CQ y head at 2y+1. */
#define KVTIER_NVME_SQ_TAIL_DOORBELL(qid, dstrd) \
    (KVTIER_NVME_REG_DOORBELL_BASE + (2u * (uint32_t)(qid)) * (4u << (dstrd)))
#define KVTIER_NVME_CQ_HEAD_DOORBELL(qid, dstrd) \
    (KVTIER_NVME_REG_DOORBELL_BASE + (2u * (uint32_t)(qid) + 1u) * (4u << (dstrd)))

/* CAP (64-bit). MQES is 0-based; TO is in 500 ms units; page sizes are
 * 2^(12 + MPSMIN/MPSMAX) bytes. */
#define KVTIER_NVME_CAP_MQES_MASK 0xffffull
#define KVTIER_NVME_CAP_CQR (1ull << 16)
#define KVTIER_NVME_CAP_AMS_SHIFT 17
#define KVTIER_NVME_CAP_TO_SHIFT 24
#define KVTIER_NVME_CAP_DSTRD_SHIFT 32
#define KVTIER_NVME_CAP_NSSRS (1ull << 36)
#define KVTIER_NVME_CAP_CSS_SHIFT 37
#define KVTIER_NVME_CAP_CSS_NVM (1ull << 37)
#define KVTIER_NVME_CAP_MPSMIN_SHIFT 48
#define KVTIER_NVME_CAP_MPSMAX_SHIFT 52

/* CC. IOSQES/IOCQES are log2 of the entry sizes (6 and 4). */
#define KVTIER_NVME_CC_EN 0x1u
#define KVTIER_NVME_CC_CSS_SHIFT 4
#define KVTIER_NVME_CC_MPS_SHIFT 7
#define KVTIER_NVME_CC_AMS_SHIFT 11
#define KVTIER_NVME_CC_SHN_SHIFT 14
#define KVTIER_NVME_CC_SHN_MASK 0xc000u
#define KVTIER_NVME_CC_IOSQES_SHIFT 16
#define KVTIER_NVME_CC_IOCQES_SHIFT 20

/* CSTS. SHST: 0 normal, 1 shutdown occurring, 2 shutdown complete. */
#define KVTIER_NVME_CSTS_RDY 0x1u
#define KVTIER_NVME_CSTS_CFS 0x2u
#define KVTIER_NVME_CSTS_SHST_SHIFT 2
#define KVTIER_NVME_CSTS_SHST_MASK 0xcu
#define KVTIER_NVME_CSTS_NSSRO 0x10u
#define KVTIER_NVME_CSTS_PP 0x20u

/* ------------------------------------------------------------- Identify -- */

/* Identify Controller byte offsets (and lengths of the ASCII fields). */
#define KVTIER_NVME_IDCTL_VID 0
#define KVTIER_NVME_IDCTL_SSVID 2
#define KVTIER_NVME_IDCTL_SN 4
#define KVTIER_NVME_IDCTL_SN_LEN 20
#define KVTIER_NVME_IDCTL_MN 24
#define KVTIER_NVME_IDCTL_MN_LEN 40
#define KVTIER_NVME_IDCTL_FR 64
#define KVTIER_NVME_IDCTL_FR_LEN 8
#define KVTIER_NVME_IDCTL_MDTS 77 /* 2^MDTS units of CAP.MPSMIN; 0 = no limit */
#define KVTIER_NVME_IDCTL_CNTLID 78
#define KVTIER_NVME_IDCTL_VER 80
#define KVTIER_NVME_IDCTL_OACS 256
#define KVTIER_NVME_IDCTL_SQES 512
#define KVTIER_NVME_IDCTL_CQES 513
#define KVTIER_NVME_IDCTL_MAXCMD 514
#define KVTIER_NVME_IDCTL_NN 516
#define KVTIER_NVME_IDCTL_ONCS 520
#define KVTIER_NVME_IDCTL_VWC 525
#define KVTIER_NVME_IDCTL_SGLS 536

/* SGLS bits 1:0: 00 none, 01 supported, 10 supported with dword alignment. */
#define KVTIER_NVME_SGLS_SUPPORT_MASK 0x3u
#define KVTIER_NVME_SGLS_BIT_BUCKET (1u << 16)

/* Identify Namespace byte offsets. LBA Format entries are 4 bytes: MS bits
 * 15:0, LBADS (log2 of the LBA size) bits 23:16, RP bits 25:24. */
#define KVTIER_NVME_IDNS_NSZE 0
#define KVTIER_NVME_IDNS_NCAP 8
#define KVTIER_NVME_IDNS_NUSE 16
#define KVTIER_NVME_IDNS_NLBAF 25
#define KVTIER_NVME_IDNS_FLBAS 26
#define KVTIER_NVME_IDNS_LBAF 128
#define KVTIER_NVME_IDNS_LBAF_LEN 4

/* -------------------------------------------------------------- structs -- */

/* Data Pointer: PRP Entry 1 and 2, or SGL Descriptor 1, by the SQE's PSDT. */
typedef union kvtier_nvme_dptr {
    struct {
        uint64_t prp1;
        uint64_t prp2;
    } prp;
    kvtier_sgl_desc sgl1;
} kvtier_nvme_dptr;

/* Submission Queue Entry (Common Command Format). */
typedef struct kvtier_nvme_sqe {
    uint8_t opcode;
    /* FUSE (bits 1:0) and PSDT (bits 7:6). */
    uint8_t flags;
    /* Command identifier, unique among the SQ's outstanding commands. */
    uint16_t cid;
    uint32_t nsid;
    uint32_t cdw2;
    uint32_t cdw3;
    uint64_t mptr;
    kvtier_nvme_dptr dptr;
    /* Read/Write: cdw10/11 SLBA low/high, cdw12 bits 15:0 NLB (0-based). */
    uint32_t cdw10;
    uint32_t cdw11;
    uint32_t cdw12;
    uint32_t cdw13;
    uint32_t cdw14;
    uint32_t cdw15;
} kvtier_nvme_sqe;

/* Completion Queue Entry. */
typedef struct kvtier_nvme_cqe {
    uint32_t dw0;
    uint32_t dw1;
    /* The controller's SQ head when it posted this entry. */
    uint16_t sq_head;
    uint16_t sq_id;
    uint16_t cid;
    /* Phase tag in bit 0; see KVTIER_NVME_CQE_STATUS(). */
    uint16_t status;
} kvtier_nvme_cqe;

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ------------------------------------------------------ layout asserts -- */

static_assert(sizeof(kvtier_nvme_dptr) == 16, "kvtier_nvme_dptr size");
static_assert(offsetof(kvtier_nvme_dptr, prp) == 0, "kvtier_nvme_dptr.prp");
static_assert(offsetof(kvtier_nvme_dptr, sgl1) == 0, "kvtier_nvme_dptr.sgl1");

static_assert(sizeof(kvtier_nvme_sqe) == KVTIER_NVME_SQE_SIZE, "kvtier_nvme_sqe size");
static_assert(KVTIER_NVME_SQE_SIZE == 64, "KVTIER_NVME_SQE_SIZE");
static_assert(offsetof(kvtier_nvme_sqe, opcode) == 0, "kvtier_nvme_sqe.opcode");
static_assert(offsetof(kvtier_nvme_sqe, flags) == 1, "kvtier_nvme_sqe.flags");
static_assert(offsetof(kvtier_nvme_sqe, cid) == 2, "kvtier_nvme_sqe.cid");
static_assert(offsetof(kvtier_nvme_sqe, nsid) == 4, "kvtier_nvme_sqe.nsid");
static_assert(offsetof(kvtier_nvme_sqe, cdw2) == 8, "kvtier_nvme_sqe.cdw2");
static_assert(offsetof(kvtier_nvme_sqe, cdw3) == 12, "kvtier_nvme_sqe.cdw3");
static_assert(offsetof(kvtier_nvme_sqe, mptr) == 16, "kvtier_nvme_sqe.mptr");
static_assert(offsetof(kvtier_nvme_sqe, dptr) == 24, "kvtier_nvme_sqe.dptr");
static_assert(offsetof(kvtier_nvme_sqe, cdw10) == 40, "kvtier_nvme_sqe.cdw10");
static_assert(offsetof(kvtier_nvme_sqe, cdw11) == 44, "kvtier_nvme_sqe.cdw11");
static_assert(offsetof(kvtier_nvme_sqe, cdw12) == 48, "kvtier_nvme_sqe.cdw12");
static_assert(offsetof(kvtier_nvme_sqe, cdw13) == 52, "kvtier_nvme_sqe.cdw13");
static_assert(offsetof(kvtier_nvme_sqe, cdw14) == 56, "kvtier_nvme_sqe.cdw14");
static_assert(offsetof(kvtier_nvme_sqe, cdw15) == 60, "kvtier_nvme_sqe.cdw15");

static_assert(sizeof(kvtier_nvme_cqe) == KVTIER_NVME_CQE_SIZE, "kvtier_nvme_cqe size");
static_assert(KVTIER_NVME_CQE_SIZE == 16, "KVTIER_NVME_CQE_SIZE");
static_assert(offsetof(kvtier_nvme_cqe, dw0) == 0, "kvtier_nvme_cqe.dw0");
static_assert(offsetof(kvtier_nvme_cqe, dw1) == 4, "kvtier_nvme_cqe.dw1");
static_assert(offsetof(kvtier_nvme_cqe, sq_head) == 8, "kvtier_nvme_cqe.sq_head");
static_assert(offsetof(kvtier_nvme_cqe, sq_id) == 10, "kvtier_nvme_cqe.sq_id");
static_assert(offsetof(kvtier_nvme_cqe, cid) == 12, "kvtier_nvme_cqe.cid");
static_assert(offsetof(kvtier_nvme_cqe, status) == 14, "kvtier_nvme_cqe.status");

static_assert(KVTIER_NVME_SGL_DESC_SIZE == KVTIER_SGL_DESC_SIZE, "SGL descriptor size");
static_assert(sizeof(kvtier_sgl_desc) == KVTIER_NVME_SGL_DESC_SIZE, "kvtier_sgl_desc size");
static_assert(KVTIER_NVME_SGL_ID_DATA_BLOCK == KVTIER_SGL_ID_DATA_BLOCK, "data block id");
static_assert(KVTIER_NVME_SGL_ID_SEGMENT ==
                  ((KVTIER_NVME_SGL_TYPE_SEGMENT << 4) | KVTIER_NVME_SGL_SUBTYPE_ADDRESS),
              "segment id");
static_assert(KVTIER_NVME_SGL_ID_LAST_SEGMENT ==
                  ((KVTIER_NVME_SGL_TYPE_LAST_SEGMENT << 4) | KVTIER_NVME_SGL_SUBTYPE_ADDRESS),
              "last segment id");
static_assert(KVTIER_NVME_SQE_FLAGS_PSDT_MASK == (3 << KVTIER_NVME_SQE_FLAGS_PSDT_SHIFT),
              "PSDT mask");

/* IOCTX opcodes are NVM opcodes. */
static_assert(KVTIER_NVME_OPC_READ == KVTIER_IOCTX_OP_READ, "read opcode");
static_assert(KVTIER_NVME_OPC_WRITE == KVTIER_IOCTX_OP_WRITE, "write opcode");
static_assert(KVTIER_NVME_OPC_FLUSH == KVTIER_IOCTX_OP_FLUSH, "flush opcode");

/* The doorbell macros at a known point: queue 1, 16-byte stride. */
static_assert(KVTIER_NVME_SQ_TAIL_DOORBELL(1, 2) == 0x1020, "SQ tail doorbell");
static_assert(KVTIER_NVME_CQ_HEAD_DOORBELL(1, 2) == 0x1030, "CQ head doorbell");

/* QEMU's short-SGL status, as it logs it, decodes to the code above. */
static_assert(KVTIER_NVME_STATUS_CODE(KVTIER_NVME_CQE_STATUS((0x400f << 1) | 1)) ==
                  KVTIER_NVME_STATUS_DATA_SGL_LENGTH_INVALID,
              "status decoding");

/* Alignment: 8 bytes (u64 fields), as on the Rust side. */
#ifdef __cplusplus
static_assert(alignof(kvtier_nvme_sqe) == 8, "kvtier_nvme_sqe alignment");
static_assert(alignof(kvtier_nvme_cqe) == 4, "kvtier_nvme_cqe alignment");
#else
static_assert(_Alignof(kvtier_nvme_sqe) == 8, "kvtier_nvme_sqe alignment");
static_assert(_Alignof(kvtier_nvme_cqe) == 4, "kvtier_nvme_cqe alignment");
#endif

#endif /* KVTIER_NVME_SPEC_H */
