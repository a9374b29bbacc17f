/*
 * gio_gpu.h: the GPU engine's device-visible state, C/CUDA side.
 *
 * The twin of src/gpu/abi.rs. The host builds these structs once (queue
 * pairs created through the admin queue, the gio_uring's ID rings, the P2P
 * table) in memory the I/O kernel can dereference (GPU memory, or pinned
 * host memory mapped into the GPU), and launches kvtier_gio_kernel
 * (kernels/gio_kernel.cu) with a pointer to one kvtier_gio_engine. The
 * kernel's logic is kernels/gio_nvme.cuh.
 *
 * Pointers are stored as uint64_t so that both sides see the same bytes on
 * every target (the Rust side derives Pod, which forbids raw pointers).
 * "Kernel pointer" means an address the code running the kernel
 * dereferences: a device pointer on the GPU, a host pointer in the host-run
 * test. "DMA address" is what the NVMe controller is given.
 *
 * Ownership: fields marked Host are written by the host before a launch and
 * only read by the kernel; fields marked Kernel are written by the kernel
 * (the host zeroes them once at set-up and reads them only while no kernel
 * runs, or to follow progress). Every struct is free of implicit padding;
 * both sides assert every size and offset, and tests/gpu_header.rs compiles
 * this header with static_asserts generated from the Rust side.
 */
#ifndef KVTIER_GIO_GPU_H
#define KVTIER_GIO_GPU_H

#include "nvme_spec.h" /* kvtier_abi.h, static_assert in C11 */

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- limits -- */

/* Threads per block the I/O kernel is launched with, at most (the size of
 * its per-thread shared-memory arrays). Launch with exactly this many. */
#define KVTIER_GIO_BLOCK_THREADS 256
/* NVMe commands one block puts in its SQ per doorbell, at most. */
#define KVTIER_GIO_MAX_BATCH 1024
/* A command id is (generation << 10) | index in the batch: the generation
 * (6 bits, advancing per batch) lets the poller drop a late completion of a
 * command that timed out in an earlier batch. */
#define KVTIER_GIO_CID_INDEX_BITS 10
#define KVTIER_GIO_CID_GEN_MASK 0x3f

/* kvtier_gio_kernel's mode argument. */
/* Process the IOCBs in the gio SQ when the kernel starts, then exit. */
#define KVTIER_GIO_MODE_ONESHOT 0
/* Keep taking IOCBs until kvtier_gio_ring.stop is non-zero and the SQ is
 * drained. */
#define KVTIER_GIO_MODE_PERSISTENT 1

#define KVTIER_GIO_QUEUE_SIZE 128
#define KVTIER_GIO_RING_SIZE 80
#define KVTIER_GIO_DEV_SIZE 8
#define KVTIER_GIO_ENGINE_SIZE 48

/* ------------------------------------------------------------ queue pair -- */

/*
 * One NVMe I/O queue pair, owned by one thread block of the I/O kernel (block
 * b drives queues[b]; no other block touches it, so no cross-block locks).
 */
typedef struct kvtier_gio_queue {
    /* Kernel pointer to the SQ: depth kvtier_nvme_sqe entries. Host. */
    uint64_t sq;
    /* Kernel pointer to the CQ: depth kvtier_nvme_cqe entries, zero-filled
     * before the queue was created. Host. */
    uint64_t cq;
    /* Kernel pointer to the SQ tail doorbell (uint32_t): BAR0 mapped into
     * the GPU, or a doorbell page. Host. */
    uint64_t sq_doorbell;
    /* Kernel pointer to the CQ head doorbell (uint32_t). Host. */
    uint64_t cq_doorbell;
    /* Kernel pointer to per-command descriptor memory: depth slots of
     * desc_bytes, slot i for the command in SQ slot i (an SGL Last Segment
     * of Data Blocks, or a PRP list). Host. */
    uint64_t desc;
    /* DMA address of desc (page-aligned, contiguous). Host. */
    uint64_t desc_dma;
    /* Poll budget per batch, in nanoseconds (%globaltimer on the GPU, a
     * steady clock on the host); commands not completed by then end with
     * KVTIER_IOCTX_STATUS_TIMEOUT. Host. */
    uint64_t timeout_ns;
    /* Bytes per descriptor slot: a multiple of page_bytes. Host. */
    uint32_t desc_bytes;
    /* Namespace of every command. Host. */
    uint32_t nsid;
    /* Largest transfer of one command (MDTS, at most 65536 LBAs), a
     * multiple of the LBA size; larger IOCTXs are split. Host. */
    uint32_t max_transfer;
    /* CC.MPS memory page size, for PRPs. Host. */
    uint32_t page_bytes;
    /* NVMe queue id (for messages). Host. */
    uint16_t qid;
    /* Entries in the SQ and in the CQ. Host. */
    uint16_t depth;
    /* log2 of the LBA size. Host. */
    uint8_t lba_shift;
    /* 1: SGLs (inline Data Block or Last Segment); 0: PRPs. Host. */
    uint8_t use_sgl;
    uint16_t reserved0;
    /* Next SQ slot to fill. Kernel (host: 0). */
    uint16_t sq_tail;
    /* The SQ head the controller last reported in a CQE. Kernel (host: 0). */
    uint16_t sq_head;
    /* Next CQ slot to look at. Kernel (host: 0). */
    uint16_t cq_head;
    /* Phase tag expected at cq_head. Kernel (host: 1). */
    uint8_t phase;
    /* Command id generation of the last batch. Kernel (host: 0). */
    uint8_t gen;
    /* This block's position in the gio SQ (free-running). Kernel (host: the
     * ring's sq_tail when the queue joins; 0 at start). */
    uint32_t ring_cursor;
    /* Commands that timed out. Kernel. */
    uint32_t timeouts;
    /* Commands completed by the controller. Kernel. */
    uint64_t commands;
    /* SQ tail doorbell writes. Kernel. */
    uint64_t doorbells;
    uint64_t reserved1[2];
} kvtier_gio_queue;

/* ------------------------------------------------------------- gio_uring -- */

/*
 * The gio_uring as the kernel sees it: an SQ and a CQ of IOCB ids over the
 * IOCB arena (kvtier_abi.h), with free-running u32 head/tail counters
 * (index = counter & (entries - 1)).
 */
typedef struct kvtier_gio_ring {
    /* Kernel pointer to the IOCB arena (iocb_count kvtier_iocb). Host. */
    uint64_t iocbs;
    /* Kernel pointer to the SQ: entries uint32_t IOCB ids. Host. */
    uint64_t sq;
    /* Kernel pointer to the CQ: entries uint32_t IOCB ids. Kernel writes. */
    uint64_t cq;
    /* Kernel pointer to iocb_count uint32_t, zeroed by the host once: how
     * many blocks have passed each IOCB. Every block looks at every IOCB
     * (it runs the IOCTXs that map to its queue); the block that passes it
     * last publishes it, so no block can still be reading an IOCB the host
     * has already reaped and refilled. Kernel. */
    uint64_t passes;
    /* Slots in each ring, a power of two >= iocb_count (so neither ring can
     * overflow while each IOCB is in flight at most once). Host. */
    uint32_t entries;
    /* IOCBs in the arena; an SQ id past it is skipped. Host. */
    uint32_t iocb_count;
    /* SQ producer counter: the host stores it (release) after the ids. */
    uint32_t sq_tail;
    /* CQ consumer counter, the host's; the kernel never reads it. */
    uint32_t cq_head;
    /* CQ producer counter: entries before it are published. Kernel. */
    uint32_t cq_tail;
    /* CQ tickets handed out; publication follows ticket order. Kernel. */
    uint32_t cq_reserve;
    /* Completion counter: +1 per completed IOCB, after its CQ entry and
     * every IOCTX status are visible (system fence first). The host waits
     * on it with cuStreamWaitValue32(GEQ) or kvtier_wait_counter. Kernel. */
    uint32_t completed;
    /* Non-zero: a persistent kernel exits once the SQ is drained. Host. */
    uint32_t stop;
    /* SQ ids past iocb_count that were skipped. Kernel. */
    uint32_t bad_ids;
    uint32_t reserved[3];
} kvtier_gio_ring;

/* ---------------------------------------------------------------- devices -- */

/* The queues of pool device d (kvtier_ioctx.dev): queues[first_queue ..
 * first_queue + queue_count); IOCTX i of an IOCB goes to
 * first_queue + i % queue_count. */
typedef struct kvtier_gio_dev {
    uint16_t first_queue;
    uint16_t queue_count;
    uint32_t reserved;
} kvtier_gio_dev;

/* ----------------------------------------------------------------- engine -- */

/* The kernel's one argument: everything above. Host. */
typedef struct kvtier_gio_engine {
    /* Kernel pointer to queue_count kvtier_gio_queue (one per block). */
    uint64_t queues;
    /* Kernel pointer to dev_count kvtier_gio_dev. */
    uint64_t devs;
    /* Kernel pointer to the P2P table: p2p_count kvtier_sgl_desc with DMA
     * addresses; IOCB segments index it. */
    uint64_t p2p;
    /* Kernel pointer to the kvtier_gio_ring. */
    uint64_t ring;
    uint64_t p2p_count;
    uint32_t queue_count;
    uint32_t dev_count;
} kvtier_gio_engine;

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ------------------------------------------------------ layout asserts -- */

static_assert(sizeof(kvtier_gio_queue) == KVTIER_GIO_QUEUE_SIZE, "kvtier_gio_queue size");
static_assert(offsetof(kvtier_gio_queue, sq) == 0, "kvtier_gio_queue.sq");
static_assert(offsetof(kvtier_gio_queue, cq) == 8, "kvtier_gio_queue.cq");
static_assert(offsetof(kvtier_gio_queue, sq_doorbell) == 16, "kvtier_gio_queue.sq_doorbell");
static_assert(offsetof(kvtier_gio_queue, cq_doorbell) == 24, "kvtier_gio_queue.cq_doorbell");
static_assert(offsetof(kvtier_gio_queue, desc) == 32, "kvtier_gio_queue.desc");
static_assert(offsetof(kvtier_gio_queue, desc_dma) == 40, "kvtier_gio_queue.desc_dma");
static_assert(offsetof(kvtier_gio_queue, timeout_ns) == 48, "kvtier_gio_queue.timeout_ns");
static_assert(offsetof(kvtier_gio_queue, desc_bytes) == 56, "kvtier_gio_queue.desc_bytes");
static_assert(offsetof(kvtier_gio_queue, nsid) == 60, "kvtier_gio_queue.nsid");
static_assert(offsetof(kvtier_gio_queue, max_transfer) == 64, "kvtier_gio_queue.max_transfer");
static_assert(offsetof(kvtier_gio_queue, page_bytes) == 68, "kvtier_gio_queue.page_bytes");
static_assert(offsetof(kvtier_gio_queue, qid) == 72, "kvtier_gio_queue.qid");
static_assert(offsetof(kvtier_gio_queue, depth) == 74, "kvtier_gio_queue.depth");
static_assert(offsetof(kvtier_gio_queue, lba_shift) == 76, "kvtier_gio_queue.lba_shift");
static_assert(offsetof(kvtier_gio_queue, use_sgl) == 77, "kvtier_gio_queue.use_sgl");
static_assert(offsetof(kvtier_gio_queue, sq_tail) == 80, "kvtier_gio_queue.sq_tail");
static_assert(offsetof(kvtier_gio_queue, sq_head) == 82, "kvtier_gio_queue.sq_head");
static_assert(offsetof(kvtier_gio_queue, cq_head) == 84, "kvtier_gio_queue.cq_head");
static_assert(offsetof(kvtier_gio_queue, phase) == 86, "kvtier_gio_queue.phase");
static_assert(offsetof(kvtier_gio_queue, gen) == 87, "kvtier_gio_queue.gen");
static_assert(offsetof(kvtier_gio_queue, ring_cursor) == 88, "kvtier_gio_queue.ring_cursor");
static_assert(offsetof(kvtier_gio_queue, timeouts) == 92, "kvtier_gio_queue.timeouts");
static_assert(offsetof(kvtier_gio_queue, commands) == 96, "kvtier_gio_queue.commands");
static_assert(offsetof(kvtier_gio_queue, doorbells) == 104, "kvtier_gio_queue.doorbells");

static_assert(sizeof(kvtier_gio_ring) == KVTIER_GIO_RING_SIZE, "kvtier_gio_ring size");
static_assert(offsetof(kvtier_gio_ring, iocbs) == 0, "kvtier_gio_ring.iocbs");
static_assert(offsetof(kvtier_gio_ring, sq) == 8, "kvtier_gio_ring.sq");
static_assert(offsetof(kvtier_gio_ring, cq) == 16, "kvtier_gio_ring.cq");
static_assert(offsetof(kvtier_gio_ring, passes) == 24, "kvtier_gio_ring.passes");
static_assert(offsetof(kvtier_gio_ring, entries) == 32, "kvtier_gio_ring.entries");
static_assert(offsetof(kvtier_gio_ring, iocb_count) == 36, "kvtier_gio_ring.iocb_count");
static_assert(offsetof(kvtier_gio_ring, sq_tail) == 40, "kvtier_gio_ring.sq_tail");
static_assert(offsetof(kvtier_gio_ring, cq_head) == 44, "kvtier_gio_ring.cq_head");
static_assert(offsetof(kvtier_gio_ring, cq_tail) == 48, "kvtier_gio_ring.cq_tail");
static_assert(offsetof(kvtier_gio_ring, cq_reserve) == 52, "kvtier_gio_ring.cq_reserve");
static_assert(offsetof(kvtier_gio_ring, completed) == 56, "kvtier_gio_ring.completed");
static_assert(offsetof(kvtier_gio_ring, stop) == 60, "kvtier_gio_ring.stop");
static_assert(offsetof(kvtier_gio_ring, bad_ids) == 64, "kvtier_gio_ring.bad_ids");

static_assert(sizeof(kvtier_gio_dev) == KVTIER_GIO_DEV_SIZE, "kvtier_gio_dev size");
static_assert(offsetof(kvtier_gio_dev, first_queue) == 0, "kvtier_gio_dev.first_queue");
static_assert(offsetof(kvtier_gio_dev, queue_count) == 2, "kvtier_gio_dev.queue_count");

static_assert(sizeof(kvtier_gio_engine) == KVTIER_GIO_ENGINE_SIZE, "kvtier_gio_engine size");
static_assert(offsetof(kvtier_gio_engine, queues) == 0, "kvtier_gio_engine.queues");
static_assert(offsetof(kvtier_gio_engine, devs) == 8, "kvtier_gio_engine.devs");
static_assert(offsetof(kvtier_gio_engine, p2p) == 16, "kvtier_gio_engine.p2p");
static_assert(offsetof(kvtier_gio_engine, ring) == 24, "kvtier_gio_engine.ring");
static_assert(offsetof(kvtier_gio_engine, p2p_count) == 32, "kvtier_gio_engine.p2p_count");
static_assert(offsetof(kvtier_gio_engine, queue_count) == 40, "kvtier_gio_engine.queue_count");
static_assert(offsetof(kvtier_gio_engine, dev_count) == 44, "kvtier_gio_engine.dev_count");

/* The batch index must fit the command id's index bits. */
static_assert(KVTIER_GIO_MAX_BATCH <= (1 << KVTIER_GIO_CID_INDEX_BITS), "batch vs cid bits");

#endif /* KVTIER_GIO_GPU_H */
