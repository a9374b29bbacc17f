/*
 * gio_nvme.cuh: the GPU I/O kernel's logic, IOCB -> NVMe commands -> gio CQ.
 *
 * Written once, compiled twice: by nvcc into kvtier_gio_kernel
 * (gio_kernel.cu), and by the host C++ compiler into the test driver
 * kernels/host/gio_host.cpp, which tests/gpu_kernel_host.rs runs against
 * the simulated NVMe controller (src/nvme/sim.rs) on machines without a GPU.
 * Everything that differs between the two is in the few primitives below
 * (system fence, atomics, volatile/acquire loads, release stores, the clock,
 * a pause) and in the two block macros: on the GPU a phase runs on every
 * thread of the block and ends in __syncthreads(); on the host the "threads"
 * of a block run one after another as a loop. A phase never reads what
 * another thread writes in the same phase, so the two give the same result.
 *
 * One thread block owns one NVMe queue pair (eng->queues[block]); nothing is
 * shared between blocks but the IOCBs (per-IOCB done/errors/passes counters,
 * system atomics) and the gio CQ (tickets, published in ticket order).
 *
 * Per IOCB, a block:
 *   1. prepare (every thread, one IOCTX each, a window of blockDim IOCTXs at
 *      a time): picks the IOCTXs whose device maps to this block's queue,
 *      validates them (op, alignment, segment range, P2P indices, length
 *      equal to the segments, every command describable) and counts their
 *      commands (an IOCTX larger than max_transfer is split);
 *   2. plan (one thread): hands out SQ slots, as many as the SQ has free and
 *      KVTIER_GIO_MAX_BATCH, by a prefix sum over the threads;
 *   3. build (every thread): writes its commands into the SQ slots: LBA from
 *      dev_offset >> lba_shift, NLB, the IOCTX's opcode, and the data pointer
 *      (an inline SGL Data Block when the command's memory is one extent
 *      after merging adjacent P2P descriptors, else a Last Segment of Data
 *      Blocks in the command's descriptor slot; with use_sgl = 0, PRP1/PRP2
 *      or a PRP list, chained across list pages);
 *   4. submit + poll (one thread): system fence, one SQ tail doorbell for
 *      the batch, then polls the CQ by phase tag until every command of the
 *      batch is seen or timeout_ns passes (the missing ones end with
 *      KVTIER_IOCTX_STATUS_TIMEOUT instead of hanging), and rings the CQ
 *      head doorbell once;
 *   5. collect (every thread): folds its commands' statuses into its IOCTX;
 *      steps 2-5 repeat until the window's commands are all done;
 *   6. finish (every thread): writes status (SCT << 8 | SC, or a
 *      KVTIER_IOCTX_STATUS_* value) and result (bytes moved) of its IOCTX;
 *   7. account (one thread): adds the block's finished/errored IOCTXs to the
 *      IOCB header, then counts itself in passes[id]; the last block to pass
 *      marks the IOCB COMPLETE, publishes its id to the gio CQ and advances
 *      the completion counter, each after a system fence.
 *
 * The NVMe status stored in an IOCTX drops DNR/More/CRD so that it stays
 * below 0x0800 as kvtier_abi.h requires: the simulator's "0x4080 LBA Out of
 * Range" is stored as 0x0080.
 */
#ifndef KVTIER_GIO_NVME_CUH
#define KVTIER_GIO_NVME_CUH

#include "gio_gpu.h"

#if defined(__CUDACC__)
#define KVTIER_HD __host__ __device__
/* Block programs use __syncthreads(): device code only. */
#define KVTIER_BLOCK_FN __device__
#else
#define KVTIER_HD
#define KVTIER_BLOCK_FN
#endif

#if !defined(__CUDA_ARCH__)
/* Host build: libc and compiler builtins only (no C++ runtime), so the
 * crate can link it into any binary, static ones included. */
#include <sched.h>
#include <time.h>
#endif

/* ------------------------------------------------------------ primitives -- */

/* Orders this thread's earlier stores (SQEs, SGL segments, IOCTX statuses)
 * before its later ones as seen by the device and by the host. */
static KVTIER_HD inline void kvtier_fence_sys(void) {
#if defined(__CUDA_ARCH__)
    __threadfence_system();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

/* Loads of memory another agent writes (CQEs, the gio SQ tail, stop):
 * acquire loads at system scope on the GPU (one access, not cached, and
 * ordering the loads after them); acquire atomics on the host, where the
 * simulator thread writes concurrently. */
static KVTIER_HD inline uint32_t kvtier_ld32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    /* Acquire at system scope: later loads (the IOCB an SQ id names, the
     * rest of a CQE) are not served from before this one (sm_70+). */
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

/* Polls: relaxed loads at system scope (one uncached access, no fence).
 * Measured on an H100, an idle loop of ld.acquire.sys on pinned host memory
 * by 8 threads slowed a copy kernel on the other SMs 2-5x (each acquire is a
 * system-scope fence); a poll loop therefore reads relaxed and takes one
 * kvtier_fence_acquire() after it saw what it waited for. */
static KVTIER_HD inline uint32_t kvtier_poll32(const uint32_t* p) {
#if defined(__CUDA_ARCH__)
    uint32_t v;
    asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/* The second half of a CQE (sq_head, sq_id, cid, status) in one access, so
 * the phase tag and the fields it validates come from the same write. */
static KVTIER_HD inline uint64_t kvtier_poll64(const uint64_t* p) {
#if defined(__CUDA_ARCH__)
    uint64_t v;
    asm volatile("ld.relaxed.sys.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
#else
    return __atomic_load_n(p, __ATOMIC_RELAXED);
#endif
}

/* After a poll saw its value: later loads are not served from before it. */
static KVTIER_HD inline void kvtier_fence_acquire(void) {
#if defined(__CUDA_ARCH__)
    asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
#endif
}

/* Stores another agent polls (doorbells, the gio CQ and its counters). */
static KVTIER_HD inline void kvtier_st32(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    *(volatile uint32_t*)p = v;
#else
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
#endif
}

/* Counters several blocks update (IOCB done/errors/passes, CQ tickets). */
static KVTIER_HD inline uint32_t kvtier_atomic_add_sys(uint32_t* p, uint32_t v) {
#if defined(__CUDA_ARCH__)
    return atomicAdd_system((unsigned int*)p, (unsigned int)v);
#else
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#endif
}

/* Nanoseconds of a monotonic clock: %globaltimer on the GPU (the same unit
 * on every GPU, unlike clock64), a steady clock on the host. */
static KVTIER_HD inline uint64_t kvtier_now_ns(void) {
#if defined(__CUDA_ARCH__)
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
#endif
}

/* Nanoseconds since start, 0 if the clock reads earlier than start. A
 * %globaltimer read on another SM may step back a little; an unsigned
 * difference would read that as ~584 years and time a batch out at once. */
static KVTIER_HD inline uint64_t kvtier_elapsed_ns(uint64_t start) {
    const int64_t d = (int64_t)(kvtier_now_ns() - start);
    return d > 0 ? (uint64_t)d : 0u;
}

/* Backs off an idle wait: the GPU thread sleeps briefly (the other warps of
 * the SM partition run), a host "block" yields its core to the simulator. */
static KVTIER_HD inline void kvtier_pause(void) {
#if defined(__CUDA_ARCH__)
    __nanosleep(256);
#else
    sched_yield();
#endif
}

/* Backs off an idle wait that may last long (a persistent kernel with no
 * IOCB to run): sleeps double each time up to KVTIER_GIO_IDLE_MAX_NS, so an
 * idle I/O kernel polls host memory rarely instead of every few hundred
 * nanoseconds, at the cost of at most that much latency on the next IOCB. */
#define KVTIER_GIO_IDLE_MAX_NS 4096u
static KVTIER_HD inline void kvtier_idle_backoff(uint32_t* ns) {
#if defined(__CUDA_ARCH__)
    __nanosleep(*ns);
#else
    sched_yield();
#endif
    if (*ns < KVTIER_GIO_IDLE_MAX_NS) {
        *ns *= 2u;
    }
}

/* ----------------------------------------------------- block composition -- */

#if defined(__CUDACC__)
/* Every thread below n runs the body, then the block synchronises. */
#define KVTIER_GIO_EACH_THREAD(tid, n, ...)  \
    do {                                     \
        const uint32_t tid = threadIdx.x;    \
        if (tid < (n)) {                     \
            __VA_ARGS__;                     \
        }                                    \
        __syncthreads();                     \
    } while (0)
/* Thread 0 runs the body, then the block synchronises. */
#define KVTIER_GIO_ONE_THREAD(...) \
    do {                           \
        if (threadIdx.x == 0) {    \
            __VA_ARGS__;           \
        }                          \
        __syncthreads();           \
    } while (0)
#define KVTIER_GIO_SHARED_ADD(p, v) atomicAdd((unsigned int*)(p), (unsigned int)(v))
#define KVTIER_GIO_SHARED_MIN(p, v) atomicMin((unsigned int*)(p), (unsigned int)(v))
#else
#define KVTIER_GIO_EACH_THREAD(tid, n, ...)           \
    do {                                              \
        for (uint32_t tid = 0; tid < (n); ++tid) {    \
            __VA_ARGS__;                              \
        }                                             \
    } while (0)
#define KVTIER_GIO_ONE_THREAD(...) \
    do {                           \
        __VA_ARGS__;               \
    } while (0)
#define KVTIER_GIO_SHARED_ADD(p, v) (*(p) += (v))
#define KVTIER_GIO_SHARED_MIN(p, v) \
    do {                            \
        if ((v) < *(p)) {           \
            *(p) = (v);             \
        }                           \
    } while (0)
#endif

/* A command slot not yet completed, in kvtier_gio_block.cmd_status. */
#define KVTIER_GIO_PENDING 0xffffu

#define KVTIER_GIO_ACT_STOP 0u
#define KVTIER_GIO_ACT_WORK 1u
#define KVTIER_GIO_ACT_SKIP 2u

/* A block's working state: __shared__ on the GPU (about 8 KiB). Per-thread
 * arrays are indexed by thread; every field is written in a phase by the
 * thread that owns it (or thread 0) and read after the barrier. */
typedef struct kvtier_gio_block {
    uint32_t action;
    uint32_t iocb_id;
    /* IOCTXs of the IOCB (0 for a header with count > KVTIER_IOCB_MAX_IOCTX). */
    uint32_t count;
    uint32_t seg_count;
    uint32_t oversize;
    uint32_t batch_n;
    uint32_t all_done;
    uint32_t stuck;
    uint32_t gen;
    /* IOCTXs this block finished / finished with an error, for this IOCB. */
    uint32_t finished;
    uint32_t errors;
    /* The batch's CQ poll: when it started, completions of this batch seen,
     * and the first of the batch's CQ slots not posted in time. */
    uint64_t poll_start;
    uint32_t seen;
    uint32_t first_miss;
    uint8_t mine[KVTIER_GIO_BLOCK_THREADS];
    uint16_t st[KVTIER_GIO_BLOCK_THREADS];
    uint32_t remaining[KVTIER_GIO_BLOCK_THREADS];
    uint32_t next_cmd[KVTIER_GIO_BLOCK_THREADS];
    uint32_t take[KVTIER_GIO_BLOCK_THREADS];
    uint32_t boff[KVTIER_GIO_BLOCK_THREADS];
    uint32_t bytes[KVTIER_GIO_BLOCK_THREADS];
    uint16_t cmd_status[KVTIER_GIO_MAX_BATCH];
} kvtier_gio_block;

/* ------------------------------------------------------ small accessors -- */

static KVTIER_HD inline kvtier_gio_ring* kvtier_gio_ring_of(const kvtier_gio_engine* eng) {
    return (kvtier_gio_ring*)(uintptr_t)eng->ring;
}

static KVTIER_HD inline kvtier_iocb* kvtier_gio_iocb(const kvtier_gio_engine* eng, uint32_t id) {
    return (kvtier_iocb*)(uintptr_t)kvtier_gio_ring_of(eng)->iocbs + id;
}

static KVTIER_HD inline kvtier_gio_queue* kvtier_gio_queue_of(const kvtier_gio_engine* eng,
                                                              uint32_t b) {
    return (kvtier_gio_queue*)(uintptr_t)eng->queues + b;
}

/* The queue IOCTX i of an IOCB goes to; *valid = 0 when its device has no
 * queue (the IOCTX is then owned, and failed as invalid, by block
 * i % queue_count, the block that visits it in kvtier_gio_stride's walk). */
static KVTIER_HD inline uint32_t kvtier_gio_owner(const kvtier_gio_engine* eng, uint16_t dev,
                                                  uint32_t i, int* valid) {
    const kvtier_gio_dev* devs = (const kvtier_gio_dev*)(uintptr_t)eng->devs;
    *valid = 0;
    const uint32_t fallback = eng->queue_count ? i % eng->queue_count : 0u;
    if (dev >= eng->dev_count || devs[dev].queue_count == 0) {
        return fallback;
    }
    const uint32_t q = (uint32_t)devs[dev].first_queue + i % devs[dev].queue_count;
    if (q >= eng->queue_count) {
        return fallback;
    }
    *valid = 1;
    return q;
}

/* Bytes of command cmd of an IOCTX split at max_transfer. */
static KVTIER_HD inline uint32_t kvtier_gio_cmd_bytes(const kvtier_ioctx* c, uint32_t mt,
                                                      uint32_t cmd) {
    const uint64_t start = (uint64_t)cmd * mt;
    const uint64_t left = (uint64_t)c->len - start;
    return (uint32_t)(left < mt ? left : mt);
}

/* ---------------------------------------------------------------- PRPs -- */

/* Writes PRP entries 2.. into a command's list slot as they come, holding
 * back the latest one so that the last slot of a list page becomes a
 * pointer to the next page only when more entries follow (the spec's rule,
 * which hw/nvme and the simulator follow). With list == NULL it only counts
 * (the dry run). */
typedef struct kvtier_prp_out {
    uint64_t* list;
    uint64_t list_dma;
    uint32_t per_page;
    uint32_t cap;
    uint32_t slot;
    uint32_t entries; /* entries emitted, PRP1 included */
    uint64_t prp1;
    uint64_t held;
    int overflow;
} kvtier_prp_out;

static KVTIER_HD inline void kvtier_prp_put(kvtier_prp_out* o, uint64_t v, int more) {
    if (more && o->slot % o->per_page == o->per_page - 1) {
        /* More entries follow v and this is a list page's last slot: it
         * points at the next list page, v goes first there. */
        if (o->slot >= o->cap) {
            o->overflow = 1;
            return;
        }
        if (o->list) {
            o->list[o->slot] = o->list_dma + (uint64_t)(o->slot + 1) * 8u;
        }
        o->slot++;
    }
    if (o->slot >= o->cap) {
        o->overflow = 1;
        return;
    }
    if (o->list) {
        o->list[o->slot] = v;
    }
    o->slot++;
}

static KVTIER_HD inline void kvtier_prp_emit(kvtier_prp_out* o, uint64_t e) {
    if (o->entries == 0) {
        o->prp1 = e;
    } else {
        if (o->entries >= 2) {
            kvtier_prp_put(o, o->held, 1);
        }
        o->held = e;
    }
    o->entries++;
}

/* ------------------------------------------------------- one command -- */

/*
 * Describes command cmd of IOCTX c: its memory (walking the IOCB's segments
 * into the P2P table from the command's first byte), and with sqe != NULL
 * writes the SQE (and its descriptor slot). Returns KVTIER_IOCTX_STATUS_OK
 * or KVTIER_IOCTX_STATUS_INVALID (too many extents for the descriptor slot,
 * memory PRPs cannot describe, a zero-length P2P entry in the middle). The
 * walk from the IOCTX's first segment costs O(segments) per command, which
 * is small: an IOCTX is a run of KV objects, a handful of commands.
 */
static KVTIER_HD inline uint16_t kvtier_gio_describe(const kvtier_gio_engine* eng,
                                                     const kvtier_gio_queue* q,
                                                     const kvtier_iocb* iocb,
                                                     const kvtier_ioctx* c, uint32_t cmd,
                                                     kvtier_nvme_sqe* sqe, uint8_t* desc,
                                                     uint64_t desc_dma, uint16_t cid) {
    const kvtier_sgl_desc* p2p = (const kvtier_sgl_desc*)(uintptr_t)eng->p2p;
    const uint32_t mt = q->max_transfer;
    const uint32_t len = c->op == KVTIER_IOCTX_OP_FLUSH ? 0 : kvtier_gio_cmd_bytes(c, mt, cmd);
    const uint64_t page = q->page_bytes;

    uint64_t cur_addr = 0, cur_len = 0;
    uint32_t pieces = 0;
    const uint32_t max_desc = q->desc_bytes / KVTIER_SGL_DESC_SIZE;
    kvtier_sgl_desc* sgl = (kvtier_sgl_desc*)desc;
    kvtier_prp_out prp;
    prp.list = sqe ? (uint64_t*)desc : (uint64_t*)0;
    prp.list_dma = desc_dma;
    prp.per_page = (uint32_t)(page / 8u);
    prp.cap = q->desc_bytes / 8u;
    prp.slot = 0;
    prp.entries = 0;
    prp.prp1 = 0;
    prp.held = 0;
    prp.overflow = 0;
    int prp_bad = 0;

    /* Closes the merged extent in cur_*: an SGL Data Block, or PRP pages. */
#define KVTIER_GIO_CLOSE_PIECE(is_last)                                                    \
    do {                                                                                   \
        if (q->use_sgl) {                                                                  \
            if (pieces <= max_desc && sqe) {                                               \
                sgl[pieces - 1].addr = cur_addr;                                           \
                sgl[pieces - 1].len = (uint32_t)cur_len;                                   \
                sgl[pieces - 1].reserved[0] = 0;                                           \
                sgl[pieces - 1].reserved[1] = 0;                                           \
                sgl[pieces - 1].reserved[2] = 0;                                           \
                sgl[pieces - 1].sgl_id = KVTIER_NVME_SGL_ID_DATA_BLOCK;                    \
            }                                                                              \
        } else {                                                                           \
            /* PRP rules: only the first extent may start inside a page (dword-aligned), \
             * only the last may end inside one. */                                        \
            if ((pieces == 1 && (cur_addr & 3u)) || (pieces > 1 && (cur_addr % page)) ||   \
                (!(is_last) && ((cur_addr + cur_len) % page))) {                           \
                prp_bad = 1;                                                               \
            }                                                                              \
            uint64_t a = cur_addr;                                                         \
            const uint64_t end = cur_addr + cur_len;                                       \
            while (a < end) {                                                              \
                kvtier_prp_emit(&prp, a);                                                  \
                a = (a / page + 1) * page;                                                 \
            }                                                                              \
        }                                                                                  \
    } while (0)

    if (len > 0) {
        const uint32_t* segs = iocb->segs + c->seg_first;
        uint64_t skip = (uint64_t)cmd * mt;
        uint64_t need = len;
        for (uint32_t s = 0; s < c->seg_count && need > 0; ++s) {
            const kvtier_sgl_desc d = p2p[segs[s]];
            if (skip >= d.len) {
                skip -= d.len;
                continue;
            }
            const uint64_t addr = d.addr + skip;
            uint64_t n = d.len - skip;
            skip = 0;
            if (n > need) {
                n = need;
            }
            need -= n;
            if (pieces > 0 && cur_addr + cur_len == addr) {
                cur_len += n; /* adjacent in DMA space: one extent */
            } else {
                if (pieces > 0) {
                    KVTIER_GIO_CLOSE_PIECE(0);
                }
                pieces++;
                cur_addr = addr;
                cur_len = n;
            }
        }
        if (need != 0 || pieces == 0) {
            return KVTIER_IOCTX_STATUS_INVALID; /* segments shorter than len */
        }
        KVTIER_GIO_CLOSE_PIECE(1);
        if (!q->use_sgl && prp.entries > 2) {
            kvtier_prp_put(&prp, prp.held, 0); /* the last entry, unchained */
        }
        if (q->use_sgl ? pieces > max_desc : (prp_bad || prp.overflow)) {
            return KVTIER_IOCTX_STATUS_INVALID;
        }
    }
#undef KVTIER_GIO_CLOSE_PIECE

    if (!sqe) {
        return KVTIER_IOCTX_STATUS_OK;
    }
    kvtier_nvme_sqe e;
    uint32_t* w = (uint32_t*)&e;
    for (int i = 0; i < 16; ++i) {
        w[i] = 0;
    }
    e.opcode = c->op;
    e.cid = cid;
    e.nsid = q->nsid;
    if (len > 0) {
        const uint64_t slba = (c->dev_offset + (uint64_t)cmd * mt) >> q->lba_shift;
        e.cdw10 = (uint32_t)slba;
        e.cdw11 = (uint32_t)(slba >> 32);
        e.cdw12 = (len >> q->lba_shift) - 1u; /* NLB, 0-based */
        if (q->use_sgl) {
            e.flags = KVTIER_NVME_PSDT_SGL_MPTR_CONTIG << KVTIER_NVME_SQE_FLAGS_PSDT_SHIFT;
            if (pieces == 1) {
                e.dptr.sgl1.addr = cur_addr;
                e.dptr.sgl1.len = (uint32_t)cur_len;
                e.dptr.sgl1.sgl_id = KVTIER_NVME_SGL_ID_DATA_BLOCK;
            } else {
                e.dptr.sgl1.addr = desc_dma;
                e.dptr.sgl1.len = pieces * KVTIER_SGL_DESC_SIZE;
                e.dptr.sgl1.sgl_id = KVTIER_NVME_SGL_ID_LAST_SEGMENT;
            }
        } else {
            e.dptr.prp.prp1 = prp.prp1;
            if (prp.entries == 2) {
                e.dptr.prp.prp2 = prp.held;
            } else if (prp.entries > 2) {
                e.dptr.prp.prp2 = desc_dma; /* the list written above */
            }
        }
    }
    *sqe = e;
    return KVTIER_IOCTX_STATUS_OK;
}

/* Validates IOCTX c for queue q and counts its commands. */
static KVTIER_HD inline uint16_t kvtier_gio_check(const kvtier_gio_engine* eng,
                                                  const kvtier_gio_queue* q,
                                                  const kvtier_iocb* iocb, const kvtier_ioctx* c,
                                                  uint32_t seg_total, uint32_t* ncmds) {
    *ncmds = 0;
    if (c->op == KVTIER_IOCTX_OP_FLUSH) {
        *ncmds = 1;
        return KVTIER_IOCTX_STATUS_OK;
    }
    if (c->op != KVTIER_IOCTX_OP_READ && c->op != KVTIER_IOCTX_OP_WRITE) {
        return KVTIER_IOCTX_STATUS_INVALID;
    }
    const uint64_t lba = 1ull << q->lba_shift;
    const uint32_t mt = q->max_transfer;
    if (c->len == 0 || c->len % lba || c->dev_offset % lba || mt < lba || mt % lba ||
        (uint64_t)mt > 65536ull * lba) {
        return KVTIER_IOCTX_STATUS_INVALID;
    }
    /* A queue the host set up wrongly fails its IOCTXs instead of dividing
     * by zero or writing past a descriptor slot. */
    const uint32_t page = q->page_bytes;
    if (q->desc_bytes < KVTIER_SGL_DESC_SIZE ||
        (!q->use_sgl && (page < 4096u || (page & (page - 1u)) || q->desc_bytes % page))) {
        return KVTIER_IOCTX_STATUS_INVALID;
    }
    if (seg_total > KVTIER_IOCB_MAX_SEGS || c->seg_count == 0 ||
        (uint64_t)c->seg_first + c->seg_count > seg_total) {
        return KVTIER_IOCTX_STATUS_INVALID;
    }
    const kvtier_sgl_desc* p2p = (const kvtier_sgl_desc*)(uintptr_t)eng->p2p;
    uint64_t sum = 0;
    for (uint32_t s = 0; s < c->seg_count; ++s) {
        const uint32_t idx = iocb->segs[c->seg_first + s];
        if (idx >= eng->p2p_count || p2p[idx].sgl_id != KVTIER_SGL_ID_DATA_BLOCK) {
            return KVTIER_IOCTX_STATUS_INVALID;
        }
        sum += p2p[idx].len;
    }
    if (sum != c->len) {
        return KVTIER_IOCTX_STATUS_INVALID;
    }
    const uint32_t n = (uint32_t)((c->len + (uint64_t)mt - 1) / mt);
    /* The dry run catches what only the built command shows (PRP alignment,
     * more SGL pieces than a descriptor slot holds). A command's SGL has at
     * most one piece per segment, so with SGLs and few enough segments
     * there is nothing to catch: skipping it saves a pass over the
     * segments and the P2P table (host reads) per IOCTX. */
    const int dry_run = !q->use_sgl || c->seg_count > q->desc_bytes / KVTIER_SGL_DESC_SIZE;
    for (uint32_t k = 0; dry_run && k < n; ++k) {
        const uint16_t st = kvtier_gio_describe(eng, q, iocb, c, k, (kvtier_nvme_sqe*)0,
                                                (uint8_t*)0, 0, 0);
        if (st != KVTIER_IOCTX_STATUS_OK) {
            return st;
        }
    }
    *ncmds = n;
    return KVTIER_IOCTX_STATUS_OK;
}

/* --------------------------------------------------------- the gio CQ -- */

/* Publishes a completed IOCB: takes a ticket, writes the id into its CQ
 * slot, waits for the earlier tickets to be published (other blocks between
 * their ticket and their store: a few instructions), then advances cq_tail
 * and the completion counter, each store after a system fence so a host
 * (or cuStreamWaitValue32) that sees the counter sees the entry and every
 * IOCTX status before it. */
static KVTIER_HD inline void kvtier_gio_publish(kvtier_gio_ring* ring, uint32_t id) {
    const uint32_t t = kvtier_atomic_add_sys(&ring->cq_reserve, 1u);
    uint32_t* cq = (uint32_t*)(uintptr_t)ring->cq;
    kvtier_st32(&cq[t & (ring->entries - 1u)], id);
    kvtier_fence_sys();
    while (kvtier_poll32(&ring->cq_tail) != t) {
        kvtier_pause();
    }
    kvtier_fence_acquire();
    kvtier_st32(&ring->cq_tail, t + 1u);
    kvtier_fence_sys();
    kvtier_st32(&ring->completed, t + 1u);
}

/* ------------------------------------------------------------- phases -- */

/* One thread: the next IOCB of the gio SQ for this block, waiting for one in
 * persistent mode. */
static KVTIER_HD inline void kvtier_gio_next(const kvtier_gio_engine* eng, kvtier_gio_queue* q,
                                             uint32_t b, uint32_t mode, kvtier_gio_block* sh) {
    kvtier_gio_ring* ring = kvtier_gio_ring_of(eng);
    const uint32_t* sq = (const uint32_t*)(uintptr_t)ring->sq;
    sh->finished = 0;
    sh->errors = 0;
    sh->count = 0;
    sh->oversize = 0;
    uint32_t idle_ns = 128u;
    for (;;) {
        const uint32_t tail = kvtier_poll32(&ring->sq_tail);
        if (q->ring_cursor != tail) {
            kvtier_fence_acquire(); /* the id and the IOCB after the tail */
            const uint32_t id = kvtier_ld32(&sq[q->ring_cursor & (ring->entries - 1u)]);
            sh->iocb_id = id;
            if (id >= ring->iocb_count) {
                if (b == 0) {
                    kvtier_atomic_add_sys(&ring->bad_ids, 1u);
                }
                sh->action = KVTIER_GIO_ACT_SKIP;
                return;
            }
            const kvtier_iocb* iocb = kvtier_gio_iocb(eng, id);
            const uint32_t count = kvtier_ld32(&iocb->hdr.count);
            sh->seg_count = kvtier_ld32(&iocb->hdr.seg_count);
            if (count > KVTIER_IOCB_MAX_IOCTX) {
                sh->oversize = 1; /* completes at once, every IOCTX an error */
            } else {
                sh->count = count;
            }
            sh->action = KVTIER_GIO_ACT_WORK;
            return;
        }
        if (mode != KVTIER_GIO_MODE_PERSISTENT || kvtier_poll32(&ring->stop) != 0) {
            sh->action = KVTIER_GIO_ACT_STOP;
            return;
        }
        kvtier_idle_backoff(&idle_ns);
    }
}

/* Every thread: IOCTX i of the window, if this block owns it. */
static KVTIER_HD inline void kvtier_gio_prepare(const kvtier_gio_engine* eng,
                                                const kvtier_gio_queue* q, uint32_t b,
                                                kvtier_gio_block* sh, uint32_t i, uint32_t tid) {
    sh->mine[tid] = 0;
    sh->remaining[tid] = 0;
    sh->take[tid] = 0;
    sh->next_cmd[tid] = 0;
    sh->bytes[tid] = 0;
    sh->st[tid] = KVTIER_IOCTX_STATUS_OK;
    if (i >= sh->count) {
        return;
    }
    const kvtier_iocb* iocb = kvtier_gio_iocb(eng, sh->iocb_id);
    const kvtier_ioctx* c = &iocb->ctx[i];
    int valid;
    if (kvtier_gio_owner(eng, c->dev, i, &valid) != b) {
        return;
    }
    sh->mine[tid] = 1;
    if (!valid) {
        sh->st[tid] = KVTIER_IOCTX_STATUS_INVALID;
        return;
    }
    uint32_t n;
    sh->st[tid] = kvtier_gio_check(eng, q, iocb, c, sh->seg_count, &n);
    sh->remaining[tid] = n;
}

/* One thread: SQ slots for this round (a prefix sum over the threads). */
static KVTIER_HD inline void kvtier_gio_plan(kvtier_gio_queue* q, kvtier_gio_block* sh,
                                             uint32_t nthreads) {
    const uint32_t depth = q->depth;
    const uint32_t used = ((uint32_t)q->sq_tail + depth - q->sq_head) % depth;
    uint32_t cap = depth - 1u - used;
    if (cap > KVTIER_GIO_MAX_BATCH) {
        cap = KVTIER_GIO_MAX_BATCH;
    }
    uint32_t off = 0;
    int any = 0;
    for (uint32_t t = 0; t < nthreads; ++t) {
        sh->take[t] = 0;
        if (!sh->mine[t] || sh->remaining[t] == 0) {
            continue;
        }
        any = 1;
        uint32_t k = sh->remaining[t];
        if (k > cap - off) {
            k = cap - off;
        }
        sh->take[t] = k;
        sh->boff[t] = off;
        off += k;
    }
    sh->batch_n = off;
    sh->all_done = !any;
    /* Work left but no free SQ slot: commands that were never fetched (a
     * hung controller). Fail what is left rather than wait forever. */
    sh->stuck = any && off == 0;
    if (off > 0) {
        q->gen = (uint8_t)((q->gen + 1u) & KVTIER_GIO_CID_GEN_MASK);
        sh->gen = q->gen;
        for (uint32_t k = 0; k < off; ++k) {
            sh->cmd_status[k] = KVTIER_GIO_PENDING;
        }
    }
}

/* Every thread: its commands of this round into their SQ slots. */
static KVTIER_HD inline void kvtier_gio_build(const kvtier_gio_engine* eng,
                                              const kvtier_gio_queue* q, kvtier_gio_block* sh,
                                              uint32_t i, uint32_t tid) {
    if (sh->take[tid] == 0) {
        return;
    }
    const kvtier_iocb* iocb = kvtier_gio_iocb(eng, sh->iocb_id);
    const kvtier_ioctx* c = &iocb->ctx[i];
    kvtier_nvme_sqe* sq = (kvtier_nvme_sqe*)(uintptr_t)q->sq;
    uint8_t* desc = (uint8_t*)(uintptr_t)q->desc;
    for (uint32_t k = 0; k < sh->take[tid]; ++k) {
        const uint32_t index = sh->boff[tid] + k;
        const uint32_t slot = (q->sq_tail + index) % q->depth;
        const uint16_t cid = (uint16_t)((sh->gen << KVTIER_GIO_CID_INDEX_BITS) | index);
        /* Validated in prepare, so this describes (the dry run took the
         * same path); a failure here would leave a zeroed SQE, which the
         * controller fails as an invalid opcode/namespace, never hangs on. */
        kvtier_gio_describe(eng, q, iocb, c, sh->next_cmd[tid] + k, &sq[slot],
                            desc + (uint64_t)slot * q->desc_bytes,
                            q->desc_dma + (uint64_t)slot * q->desc_bytes, cid);
    }
    /* This thread's SQEs and descriptors before the doorbell thread 0 rings
     * after the barrier. */
    kvtier_fence_sys();
}

/* Records one posted CQE (its second half, read at once with the phase tag)
 * against the batch: a command of this batch not yet completed takes its
 * status; a late completion of an earlier batch's timed-out command has
 * another generation and is dropped. Returns 1 when it completed one. */
static KVTIER_HD inline uint32_t kvtier_gio_take_cqe(kvtier_gio_block* sh, uint64_t half) {
    const uint16_t cid = (uint16_t)(half >> 32);
    const uint16_t status = (uint16_t)(half >> 48);
    const uint32_t index = cid & ((1u << KVTIER_GIO_CID_INDEX_BITS) - 1u);
    const uint32_t gen = (uint32_t)cid >> KVTIER_GIO_CID_INDEX_BITS;
    if (gen == sh->gen && index < sh->batch_n && sh->cmd_status[index] == KVTIER_GIO_PENDING) {
        sh->cmd_status[index] = KVTIER_NVME_STATUS_CODE(KVTIER_NVME_CQE_STATUS(status));
        return 1u;
    }
    return 0u;
}

static KVTIER_HD inline const uint64_t* kvtier_gio_cqe_half(const kvtier_gio_queue* q,
                                                            uint32_t slot) {
    return (const uint64_t*)(uintptr_t)(q->cq + (uint64_t)slot * sizeof(kvtier_nvme_cqe) + 8u);
}

/* One thread: one SQ doorbell for the batch. */
static KVTIER_HD inline void kvtier_gio_ring_sq(kvtier_gio_queue* q, kvtier_gio_block* sh) {
    const uint32_t n = sh->batch_n;
    kvtier_fence_sys();
    q->sq_tail = (uint16_t)((q->sq_tail + n) % q->depth);
    kvtier_st32((uint32_t*)(uintptr_t)q->sq_doorbell, q->sq_tail);
    q->doorbells++;
    sh->poll_start = kvtier_now_ns();
    sh->seen = 0;
    sh->first_miss = n;
}

/* Every thread: waits for the CQ slots cq_head + tid, + tid + nthreads, ...
 * below cq_head + batch_n, all at once. A controller posts CQEs in slot
 * order, so the batch's completions fill exactly those slots unless a late
 * completion of an earlier batch took one (then the serial pass in
 * kvtier_gio_reap takes the rest). Polling them in parallel costs one
 * round trip to the CQ's memory per batch instead of one per command. */
static KVTIER_HD inline void kvtier_gio_poll_slots(const kvtier_gio_queue* q,
                                                   kvtier_gio_block* sh, uint32_t tid,
                                                   uint32_t nthreads) {
    const uint32_t n = sh->batch_n, depth = q->depth;
    for (uint32_t k = tid; k < n; k += nthreads) {
        const uint32_t pos = (uint32_t)q->cq_head + k;
        const uint32_t slot = pos % depth;
        const uint32_t phase = (uint32_t)q->phase ^ (pos >= depth ? 1u : 0u);
        const uint64_t* half = kvtier_gio_cqe_half(q, slot);
        uint32_t spins = 0;
        for (;;) {
            const uint64_t h = kvtier_poll64(half);
            if (((uint32_t)(h >> 48) & KVTIER_NVME_CQE_STATUS_PHASE) == phase) {
                if (kvtier_gio_take_cqe(sh, h)) {
                    KVTIER_GIO_SHARED_ADD(&sh->seen, 1u);
                }
                break;
            }
            if ((++spins & 63u) == 0 && kvtier_elapsed_ns(sh->poll_start) >= q->timeout_ns) {
                KVTIER_GIO_SHARED_MIN(&sh->first_miss, k);
                break; /* later slots of this thread cannot be posted either */
            }
            kvtier_pause();
        }
        if (sh->first_miss <= k) {
            break;
        }
    }
    kvtier_fence_acquire();
}

/* One thread: consumes the slots the parallel poll saw, takes any
 * completions still missing one by one (a late CQE of an earlier batch in
 * the way), rings the CQ doorbell once, and times out what never came. */
static KVTIER_HD inline void kvtier_gio_reap(kvtier_gio_queue* q, kvtier_gio_block* sh) {
    const uint32_t n = sh->batch_n;
    const uint16_t depth = q->depth;
    uint32_t seen = sh->seen, consumed = sh->first_miss, spins = 0;
    if (consumed > 0) {
        const uint32_t pos = (uint32_t)q->cq_head + consumed;
        if (pos >= depth) {
            q->phase ^= 1u;
        }
        q->cq_head = (uint16_t)(pos % depth);
        const uint64_t last = kvtier_poll64(kvtier_gio_cqe_half(q, (q->cq_head + depth - 1u) % depth));
        q->sq_head = (uint16_t)last;
    }
    while (seen < n) {
        const uint64_t h = kvtier_poll64(kvtier_gio_cqe_half(q, q->cq_head));
        if (((uint32_t)(h >> 48) & KVTIER_NVME_CQE_STATUS_PHASE) == q->phase) {
            if (++q->cq_head == depth) {
                q->cq_head = 0;
                q->phase ^= 1u;
            }
            consumed++;
            q->sq_head = (uint16_t)h;
            seen += kvtier_gio_take_cqe(sh, h);
            continue;
        }
        if ((++spins & 63u) == 0 && kvtier_elapsed_ns(sh->poll_start) >= q->timeout_ns) {
            break;
        }
        kvtier_pause();
    }
    if (consumed > 0) {
        kvtier_st32((uint32_t*)(uintptr_t)q->cq_doorbell, q->cq_head);
    }
    for (uint32_t k = 0; k < n; ++k) {
        if (sh->cmd_status[k] == KVTIER_GIO_PENDING) {
            sh->cmd_status[k] = KVTIER_IOCTX_STATUS_TIMEOUT;
            q->timeouts++;
        }
    }
    q->commands += seen;
}

/* Every thread: fold this round's command statuses into its IOCTX. */
static KVTIER_HD inline void kvtier_gio_collect(const kvtier_gio_engine* eng,
                                                const kvtier_gio_queue* q, kvtier_gio_block* sh,
                                                uint32_t i, uint32_t tid) {
    if (!sh->mine[tid] || sh->remaining[tid] == 0) {
        return;
    }
    if (sh->stuck) {
        if (sh->st[tid] == KVTIER_IOCTX_STATUS_OK) {
            sh->st[tid] = KVTIER_IOCTX_STATUS_TIMEOUT;
        }
        sh->remaining[tid] = 0;
        return;
    }
    const kvtier_ioctx* c = &kvtier_gio_iocb(eng, sh->iocb_id)->ctx[i];
    for (uint32_t k = 0; k < sh->take[tid]; ++k) {
        const uint16_t s = sh->cmd_status[sh->boff[tid] + k];
        if (s == KVTIER_IOCTX_STATUS_OK) {
            if (c->op != KVTIER_IOCTX_OP_FLUSH) {
                sh->bytes[tid] += kvtier_gio_cmd_bytes(c, q->max_transfer, sh->next_cmd[tid] + k);
            }
        } else if (sh->st[tid] == KVTIER_IOCTX_STATUS_OK) {
            sh->st[tid] = s; /* the first failure names the IOCTX's status */
        }
    }
    sh->next_cmd[tid] += sh->take[tid];
    sh->remaining[tid] -= sh->take[tid];
}

/* Every thread: status and result of its IOCTX. */
static KVTIER_HD inline void kvtier_gio_finish(const kvtier_gio_engine* eng,
                                               kvtier_gio_block* sh, uint32_t i, uint32_t tid) {
    if (!sh->mine[tid]) {
        return;
    }
    kvtier_ioctx* c = &kvtier_gio_iocb(eng, sh->iocb_id)->ctx[i];
    c->result = sh->bytes[tid];
    c->status = sh->st[tid];
    KVTIER_GIO_SHARED_ADD(&sh->finished, 1u);
    if (sh->st[tid] != KVTIER_IOCTX_STATUS_OK) {
        KVTIER_GIO_SHARED_ADD(&sh->errors, 1u);
    }
}

/* One thread: this block's share of the IOCB into its header; the last
 * block to pass the IOCB completes and publishes it. Then the next SQ entry. */
static KVTIER_HD inline void kvtier_gio_account(const kvtier_gio_engine* eng,
                                                kvtier_gio_queue* q, kvtier_gio_block* sh) {
    kvtier_gio_ring* ring = kvtier_gio_ring_of(eng);
    if (sh->action == KVTIER_GIO_ACT_WORK) {
        kvtier_iocb* iocb = kvtier_gio_iocb(eng, sh->iocb_id);
        /* The IOCTX statuses this block wrote, before the counters. */
        kvtier_fence_sys();
        if (sh->errors) {
            kvtier_atomic_add_sys(&iocb->hdr.errors, sh->errors);
        }
        if (sh->finished) {
            kvtier_atomic_add_sys(&iocb->hdr.done, sh->finished);
        }
        uint32_t* passes = (uint32_t*)(uintptr_t)ring->passes + sh->iocb_id;
        if (kvtier_atomic_add_sys(passes, 1u) + 1u == eng->queue_count) {
            kvtier_st32(passes, 0); /* ready for the IOCB's next submission */
            if (sh->oversize) {
                const uint32_t count = kvtier_ld32(&iocb->hdr.count);
                kvtier_st32(&iocb->hdr.errors, count);
                kvtier_st32(&iocb->hdr.done, count);
            }
            kvtier_fence_sys();
            kvtier_st32(&iocb->hdr.state, KVTIER_IOCB_STATE_COMPLETE);
            kvtier_fence_sys();
            kvtier_gio_publish(ring, sh->iocb_id);
        }
    }
    q->ring_cursor++;
}

/* Which IOCTXs block b must look at: i = *first + k * *stride. With one
 * device served by every queue, IOCTX i belongs to block i % queue_count
 * (valid or not), so each block walks only its own and fills whole windows
 * of its threads; otherwise ownership depends on each IOCTX's device and
 * every block walks them all. */
static KVTIER_HD inline void kvtier_gio_stride(const kvtier_gio_engine* eng, uint32_t b,
                                               uint32_t* first, uint32_t* stride) {
    const kvtier_gio_dev* devs = (const kvtier_gio_dev*)(uintptr_t)eng->devs;
    *first = 0;
    *stride = 1;
    if (eng->dev_count == 1 && devs[0].first_queue == 0 &&
        devs[0].queue_count == eng->queue_count && eng->queue_count > 0) {
        *first = b;
        *stride = eng->queue_count;
    }
}

/* -------------------------------------------------------- the program -- */

/*
 * What one block runs: block b drives eng->queues[b] with nthreads threads
 * (at most KVTIER_GIO_BLOCK_THREADS), until the gio SQ is empty (ONESHOT) or
 * the ring's stop flag is set and the SQ drained (PERSISTENT). sh is the
 * block's shared state. Every branch below reads shared state written
 * before a barrier, so all threads of a block take the same path.
 */
KVTIER_BLOCK_FN static inline void kvtier_gio_run_block(const kvtier_gio_engine* eng, uint32_t b,
                                                        uint32_t nthreads, uint32_t mode,
                                                        kvtier_gio_block* sh) {
    if (b >= eng->queue_count) {
        return;
    }
    if (nthreads > KVTIER_GIO_BLOCK_THREADS) {
        nthreads = KVTIER_GIO_BLOCK_THREADS;
    }
    kvtier_gio_queue* q = kvtier_gio_queue_of(eng, b);
    uint32_t first, stride;
    kvtier_gio_stride(eng, b, &first, &stride);
    for (;;) {
        KVTIER_GIO_ONE_THREAD(kvtier_gio_next(eng, q, b, mode, sh));
        if (sh->action == KVTIER_GIO_ACT_STOP) {
            break;
        }
        for (uint32_t win = 0; first + win * stride < sh->count; win += nthreads) {
            KVTIER_GIO_EACH_THREAD(tid, nthreads,
                                   kvtier_gio_prepare(eng, q, b, sh, first + (win + tid) * stride, tid));
            for (;;) {
                KVTIER_GIO_ONE_THREAD(kvtier_gio_plan(q, sh, nthreads));
                if (sh->all_done) {
                    break;
                }
                if (!sh->stuck) {
                    KVTIER_GIO_EACH_THREAD(tid, nthreads, kvtier_gio_build(eng, q, sh, first + (win + tid) * stride, tid));
                    KVTIER_GIO_ONE_THREAD(kvtier_gio_ring_sq(q, sh));
                    KVTIER_GIO_EACH_THREAD(tid, nthreads, kvtier_gio_poll_slots(q, sh, tid, nthreads));
                    KVTIER_GIO_ONE_THREAD(kvtier_gio_reap(q, sh));
                }
                KVTIER_GIO_EACH_THREAD(tid, nthreads, kvtier_gio_collect(eng, q, sh, first + (win + tid) * stride, tid));
            }
            KVTIER_GIO_EACH_THREAD(tid, nthreads, kvtier_gio_finish(eng, sh, first + (win + tid) * stride, tid));
        }
        KVTIER_GIO_ONE_THREAD(kvtier_gio_account(eng, q, sh));
    }
}

/* Whether a free-running counter has reached target (wrap-safe, as
 * cuStreamWaitValue32's GEQ compares). */
static KVTIER_HD inline int kvtier_counter_reached(uint32_t value, uint32_t target) {
    return (int32_t)(value - target) >= 0;
}

/* The wait path's logic: spins until *counter reaches target (returns 1) or
 * timeout_ns passes (0: no limit; returns 0). Then a system fence, so what
 * the I/O kernel wrote before the counter is seen after it. */
static KVTIER_HD inline int kvtier_gio_wait(const uint32_t* counter, uint32_t target,
                                            uint64_t timeout_ns) {
    const uint64_t start = kvtier_now_ns();
    while (!kvtier_counter_reached(kvtier_poll32(counter), target)) {
        if (timeout_ns != 0 && kvtier_elapsed_ns(start) >= timeout_ns) {
            return 0;
        }
        kvtier_pause();
    }
    kvtier_fence_sys();
    return 1;
}

#endif /* KVTIER_GIO_NVME_CUH */
