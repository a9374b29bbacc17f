/*
 * kvtier_abi.h: the gio_uring binary interface, C/CUDA side.
 *
 * This is the twin of src/ring/abi.rs. The same bytes are read and written by
 * the host runtime (Rust), the host engines (io_uring, VFIO NVMe) and the CUDA
 * I/O kernels, which read IOCBs straight out of GPU-visible memory and turn
 * each IOCTX into NVMe commands. There is no serialisation step between them,
 * so the two definitions must agree to the byte: both sides assert every size
 * and offset, and tests/abi_header.rs compiles this header (as C11, C++17 and,
 * where nvcc is found, CUDA) together with static_asserts generated from
 * kvtier::ring::abi::abi_constants(), so a drift on either side fails a build.
 *
 * Ownership of fields follows io_uring: the submitter writes the request
 * fields before submit; the engine writes only status/result of each IOCTX
 * and done/errors of the IOCB header; the submitter reads them only after the
 * IOCB id has come back through the completion queue.
 *
 * Rules for editing: change abi.rs and this file together; never reorder
 * fields; keep every struct free of implicit padding (Rust derives Pod, which
 * forbids padding, and a GPU kernel must not depend on what is in padding).
 *
 * Compiles as C11, C++17 and CUDA (nvcc); it only needs <stdint.h>,
 * <stddef.h> and <assert.h>.
 */
#ifndef KVTIER_ABI_H
#define KVTIER_ABI_H

#include <stddef.h> /* offsetof */
#include <stdint.h>

/*
 * static_assert: a keyword in C++11 and later (so also under nvcc, which
 * compiles .cu as C++); in C11 it is a macro from <assert.h> that expands to
 * _Static_assert. Including <assert.h> from C++ is harmless.
 */
#ifndef __cplusplus
#include <assert.h>
#if !defined(static_assert)
#define static_assert _Static_assert
#endif
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- limits -- */

/*
 * IOCTXs per IOCB: one per thread of a 2-SM scheduling unit on Hopper
 * (2 SMs x 64 warps x 32 threads), so a GPU engine gives each IOCTX a thread.
 */
#define KVTIER_IOCB_MAX_IOCTX 2048

/*
 * Memory segments per IOCB. A segment is one P2P-table index (one KV object,
 * or one staging buffer), so a coalesced IOCTX covering a run of G blocks of
 * one layer uses 2G segments. 16384 covers one full layer of a 128K-token
 * llama3-8b prefix at block size 16 in one IOCB (8192 blocks x K|V).
 */
#define KVTIER_IOCB_MAX_SEGS 16384

/*
 * Sizes as literal numbers (not sizeof) so that the preprocessor, the header
 * test and host code that sizes GPU allocations can use them; the
 * static_asserts below tie them to the structs.
 */
#define KVTIER_IOCTX_SIZE 32
#define KVTIER_IOCB_HEADER_SIZE 32
/* 32 + 32 * 2048 + 4 * 16384 */
#define KVTIER_IOCB_SIZE 131104
#define KVTIER_SGL_DESC_SIZE 16

/* ------------------------------------------------------------- opcodes -- */

/*
 * IOCTX opcodes are NVMe NVM command set opcodes so the GPU kernel copies them
 * into the SQE unchanged.
 */
#define KVTIER_IOCTX_OP_FLUSH 0x00
#define KVTIER_IOCTX_OP_WRITE 0x01
#define KVTIER_IOCTX_OP_READ 0x02

/* -------------------------------------------------------- IOCTX status -- */

/*
 * kvtier_ioctx.status values. 0 is success. Values below 0x0800 are NVMe
 * status fields (SCT << 8 | SC) reported by an NVMe engine; the values here
 * are for failures an NVMe status cannot express.
 */
#define KVTIER_IOCTX_STATUS_OK 0x0000
/* The OS failed the I/O; result holds the errno (io_uring engine). */
#define KVTIER_IOCTX_STATUS_ERRNO 0x8000
/* The device transferred fewer bytes than asked; result holds how many. */
#define KVTIER_IOCTX_STATUS_SHORT 0x8001
/*
 * The IOCTX itself is malformed (bad device index, segment range, length that
 * disagrees with its segments); result is 0.
 */
#define KVTIER_IOCTX_STATUS_INVALID 0x8002
/*
 * The device did not complete the I/O in time: the nvme engine's I/O timeout
 * (it then stops the controller, so the I/O can no longer land) or the GPU
 * engine's per-batch poll budget. result holds the bytes of the IOCTX's
 * commands that did complete (GPU engine) or 0 (nvme engine).
 */
#define KVTIER_IOCTX_STATUS_TIMEOUT 0x8003

/* ---------------------------------------------------------- IOCB state -- */

/* kvtier_iocb_header.state values. */
/* In the ring's free list. */
#define KVTIER_IOCB_STATE_FREE 0
/* Handed out by get_iocb, being filled by the submitter. */
#define KVTIER_IOCB_STATE_FILLING 1
/* In the submission queue or being executed by the engine. */
#define KVTIER_IOCB_STATE_SUBMITTED 2
/* Every IOCTX has completed; its id is (or was) in the completion queue. */
#define KVTIER_IOCB_STATE_COMPLETE 3

/* ------------------------------------------------------------ SGL ids -- */

/*
 * NVMe SGL descriptor type "Data Block" (0h) with subtype "Address" (0h), in
 * the identifier byte's high and low nibble.
 */
#define KVTIER_SGL_ID_DATA_BLOCK 0x00

/* -------------------------------------------------------------- IOCTX -- */

/*
 * One I/O: a device extent and the memory it moves to or from.
 *
 * Memory is named indirectly, by a range of P2P-table indices kept in the
 * IOCB's segment array, never by raw address: the table is built once at
 * registration (host addresses now, GPU/IOVA addresses for the GPU and NVMe
 * engines), so the per-I/O work is a table lookup, and a 16-byte SGL
 * data-block descriptor per segment is all the NVMe command needs.
 *
 * Written by the submitter before submit, except status and result, which
 * the engine writes at completion.
 */
typedef struct kvtier_ioctx {
    /* Byte offset on the device; a multiple of the device's direct-I/O
     * alignment (4096). Ignored for FLUSH. Submitter. */
    uint64_t dev_offset;
    /* Bytes to move; equals the sum of the segments' lengths. 0 for FLUSH.
     * Submitter. */
    uint32_t len;
    /* First entry of this IOCTX's segments in kvtier_iocb.segs. Submitter. */
    uint32_t seg_first;
    /* Number of segments; memory is the concatenation of their extents in
     * order. Submitter. */
    uint16_t seg_count;
    /* Device index within the pool (0-based). Submitter. */
    uint16_t dev;
    /* KVTIER_IOCTX_OP_*. Submitter. */
    uint8_t op;
    /* Reserved for future use (FUA, priority); must be 0. Submitter. */
    uint8_t flags;
    /* Written by the engine at completion: KVTIER_IOCTX_STATUS_* or an NVMe
     * status. */
    uint16_t status;
    /* Written by the engine at completion: bytes moved on success, errno for
     * KVTIER_IOCTX_STATUS_ERRNO, bytes moved for KVTIER_IOCTX_STATUS_SHORT. */
    uint32_t result;
    /* The submitter's own tag (the tier stores a run index); engines never
     * read it. */
    uint32_t tag;
} kvtier_ioctx;

/* --------------------------------------------------------- IOCB header -- */

typedef struct kvtier_iocb_header {
    /* The IOCB's index in the ring's arena; set once by the ring when the
     * arena is created, never changes. */
    uint32_t id;
    /* IOCTXs in use: ctx[0 .. count). Submitter. */
    uint32_t count;
    /* Segments in use: segs[0 .. seg_count). Submitter. */
    uint32_t seg_count;
    /* KVTIER_IOCB_STATE_*. The ring moves it FREE -> FILLING (get_iocb) ->
     * SUBMITTED (submit) -> COMPLETE (engine) -> FREE (release). */
    uint32_t state;
    /* IOCTXs completed so far (engine-owned while SUBMITTED). */
    uint32_t done;
    /* IOCTXs completed with a non-zero status (engine-owned while
     * SUBMITTED). */
    uint32_t errors;
    /* The submitter's cookie, returned untouched (the tier stores a job/phase
     * id). */
    uint64_t user_data;
} kvtier_iocb_header;

/* ---------------------------------------------------------------- IOCB -- */

/* A batch of up to KVTIER_IOCB_MAX_IOCTX IOCTXs, completed as one. */
typedef struct kvtier_iocb {
    kvtier_iocb_header hdr;
    kvtier_ioctx ctx[KVTIER_IOCB_MAX_IOCTX];
    /* P2P-table indices referenced by the IOCTXs' segment ranges. Submitter. */
    uint32_t segs[KVTIER_IOCB_MAX_SEGS];
} kvtier_iocb;

/* ---------------------------------------------------- SGL descriptor -- */

/*
 * A 16-byte NVMe SGL Data Block descriptor (NVMe base spec, "SGL Data Block
 * descriptor"): one contiguous memory extent. The P2P table is an array of
 * these, written once at registration by the host; a GPU kernel copies
 * entries straight into an SGL segment.
 */
typedef struct kvtier_sgl_desc {
    /* Memory address the device DMAs to/from (host virtual for the io_uring
     * engine, IOVA for VFIO, GPU physical/BAR address for the GPU engine). */
    uint64_t addr;
    /* Extent length in bytes. */
    uint32_t len;
    /* Must be 0 (the NVMe spec reserves these bytes). */
    uint8_t reserved[3];
    /* SGL identifier: descriptor type (high nibble) and subtype (low
     * nibble); KVTIER_SGL_ID_DATA_BLOCK for a memory extent. */
    uint8_t sgl_id;
} kvtier_sgl_desc;

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ------------------------------------------------------ layout asserts -- */

/*
 * The same numbers src/ring/abi.rs asserts. If one fails, the two sides
 * disagree and every IOCB exchanged between them would be misread.
 */
static_assert(sizeof(kvtier_ioctx) == KVTIER_IOCTX_SIZE, "kvtier_ioctx size");
static_assert(KVTIER_IOCTX_SIZE == 32, "KVTIER_IOCTX_SIZE");
static_assert(offsetof(kvtier_ioctx, dev_offset) == 0, "kvtier_ioctx.dev_offset");
static_assert(offsetof(kvtier_ioctx, len) == 8, "kvtier_ioctx.len");
static_assert(offsetof(kvtier_ioctx, seg_first) == 12, "kvtier_ioctx.seg_first");
static_assert(offsetof(kvtier_ioctx, seg_count) == 16, "kvtier_ioctx.seg_count");
static_assert(offsetof(kvtier_ioctx, dev) == 18, "kvtier_ioctx.dev");
static_assert(offsetof(kvtier_ioctx, op) == 20, "kvtier_ioctx.op");
static_assert(offsetof(kvtier_ioctx, flags) == 21, "kvtier_ioctx.flags");
static_assert(offsetof(kvtier_ioctx, status) == 22, "kvtier_ioctx.status");
static_assert(offsetof(kvtier_ioctx, result) == 24, "kvtier_ioctx.result");
static_assert(offsetof(kvtier_ioctx, tag) == 28, "kvtier_ioctx.tag");

static_assert(sizeof(kvtier_iocb_header) == KVTIER_IOCB_HEADER_SIZE, "kvtier_iocb_header size");
static_assert(KVTIER_IOCB_HEADER_SIZE == 32, "KVTIER_IOCB_HEADER_SIZE");
static_assert(offsetof(kvtier_iocb_header, id) == 0, "kvtier_iocb_header.id");
static_assert(offsetof(kvtier_iocb_header, count) == 4, "kvtier_iocb_header.count");
static_assert(offsetof(kvtier_iocb_header, seg_count) == 8, "kvtier_iocb_header.seg_count");
static_assert(offsetof(kvtier_iocb_header, state) == 12, "kvtier_iocb_header.state");
static_assert(offsetof(kvtier_iocb_header, done) == 16, "kvtier_iocb_header.done");
static_assert(offsetof(kvtier_iocb_header, errors) == 20, "kvtier_iocb_header.errors");
static_assert(offsetof(kvtier_iocb_header, user_data) == 24, "kvtier_iocb_header.user_data");

static_assert(offsetof(kvtier_iocb, hdr) == 0, "kvtier_iocb.hdr");
static_assert(offsetof(kvtier_iocb, ctx) == 32, "kvtier_iocb.ctx");
static_assert(offsetof(kvtier_iocb, segs) == 32 + 32 * KVTIER_IOCB_MAX_IOCTX, "kvtier_iocb.segs");
static_assert(sizeof(kvtier_iocb) == KVTIER_IOCB_SIZE, "kvtier_iocb size");
static_assert(KVTIER_IOCB_SIZE == 32 + 32 * KVTIER_IOCB_MAX_IOCTX + 4 * KVTIER_IOCB_MAX_SEGS,
              "KVTIER_IOCB_SIZE");

static_assert(sizeof(kvtier_sgl_desc) == KVTIER_SGL_DESC_SIZE, "kvtier_sgl_desc size");
static_assert(KVTIER_SGL_DESC_SIZE == 16, "KVTIER_SGL_DESC_SIZE");
static_assert(offsetof(kvtier_sgl_desc, addr) == 0, "kvtier_sgl_desc.addr");
static_assert(offsetof(kvtier_sgl_desc, len) == 8, "kvtier_sgl_desc.len");
static_assert(offsetof(kvtier_sgl_desc, reserved) == 12, "kvtier_sgl_desc.reserved");
static_assert(offsetof(kvtier_sgl_desc, sgl_id) == 15, "kvtier_sgl_desc.sgl_id");

/*
 * Alignment: the Rust structs are repr(C) with a u64 first field, so they are
 * 8-byte aligned; a GPU kernel loading them with 8-byte accesses relies on it.
 */
#ifdef __cplusplus
static_assert(alignof(kvtier_ioctx) == 8, "kvtier_ioctx alignment");
static_assert(alignof(kvtier_iocb_header) == 8, "kvtier_iocb_header alignment");
static_assert(alignof(kvtier_iocb) == 8, "kvtier_iocb alignment");
static_assert(alignof(kvtier_sgl_desc) == 8, "kvtier_sgl_desc alignment");
#else
static_assert(_Alignof(kvtier_ioctx) == 8, "kvtier_ioctx alignment");
static_assert(_Alignof(kvtier_iocb_header) == 8, "kvtier_iocb_header alignment");
static_assert(_Alignof(kvtier_iocb) == 8, "kvtier_iocb alignment");
static_assert(_Alignof(kvtier_sgl_desc) == 8, "kvtier_sgl_desc alignment");
#endif

#endif /* KVTIER_ABI_H */
