// null_nvme.cu: a null NVMe controller that lives on the GPU (a test double).
//
// It exists to measure the I/O kernel's own command rate with no device and
// no host thread in the loop: the I/O kernel's queue pairs (SQ, CQ and both
// doorbells) are put in GPU memory, and this kernel plays the controller on
// other SMs. It completes every command at once with success and moves no
// data, so what is measured is the command path: IOCB fetch, planning, SGL
// or PRP building, doorbells, CQ polling, IOCB completion.
//
// kvtier_null_nvme(const kvtier_gio_queue* queues, uint32_t count,
//                  const uint32_t* stop, kvtier_null_stats* stats)
//   Launch with gridDim.x = count, blockDim.x = 32 (one warp per queue).
//   Reads only the host-written fields of each queue (sq, cq, sq_doorbell,
//   depth, qid, lba_shift), never the I/O kernel's own. Runs until *stop is
//   non-zero (the host sets it after the I/O kernel has exited).
//
// Why one warp per queue: a batch of up to KVTIER_GIO_MAX_BATCH commands is
// completed 32 entries per step, so the double is never the slower side.
// CQ slot == SQ slot: both queues have the same depth and every command is
// completed in order, so the controller's SQ head and CQ tail move together.

#include "gio_gpu.h"

typedef struct kvtier_null_stats {
    /* Commands completed. */
    unsigned long long commands;
    /* Logical blocks the commands named (NLB + 1 each). */
    unsigned long long blocks;
    /* Commands whose opcode was neither read (0x02) nor write (0x01). */
    unsigned long long bad_opcodes;
    unsigned long long reserved;
} kvtier_null_stats;

static_assert(sizeof(kvtier_null_stats) == 32, "kvtier_null_stats size");

static __device__ __forceinline__ uint32_t null_ld_acquire_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ uint32_t null_ld_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

extern "C" __global__ void __launch_bounds__(32)
    kvtier_null_nvme(const kvtier_gio_queue* __restrict__ queues, uint32_t count,
                     const uint32_t* __restrict__ stop, kvtier_null_stats* __restrict__ stats) {
    const uint32_t b = blockIdx.x;
    const uint32_t lane = threadIdx.x;
    if (b >= count) {
        return;
    }
    const kvtier_gio_queue* q = &queues[b];
    const kvtier_nvme_sqe* sq = (const kvtier_nvme_sqe*)(uintptr_t)q->sq;
    kvtier_nvme_cqe* cq = (kvtier_nvme_cqe*)(uintptr_t)q->cq;
    const uint32_t* doorbell = (const uint32_t*)(uintptr_t)q->sq_doorbell;
    const uint32_t depth = q->depth;
    const uint16_t qid = q->qid;
    // Free-running count of commands completed; slot = done % depth, and the
    // phase tag flips on each pass over the CQ (1 on the first: the CQ was
    // zero-filled).
    unsigned long long done = 0, blocks = 0, bad = 0;
    uint32_t idle = 0, sleep_ns = 32;
    for (;;) {
        const uint32_t tail = null_ld_acquire_gpu(doorbell) % depth;
        const uint32_t head = (uint32_t)(done % depth);
        uint32_t pending = (tail + depth - head) % depth;
        if (pending == 0) {
            if ((++idle & 15u) == 0 && null_ld_acquire_sys(stop) != 0) {
                break;
            }
            // Like a real controller's doorbell, the poll costs the other
            // SMs nothing; sleep longer while idle, wake fast when busy.
            __nanosleep(sleep_ns);
            sleep_ns = sleep_ns < 2048u ? sleep_ns * 2u : sleep_ns;
            continue;
        }
        idle = 0;
        sleep_ns = 32;
        while (pending > 0) {
            const uint32_t n = pending < 32u ? pending : 32u;
            if (lane < n) {
                const unsigned long long k = done + lane;
                const uint32_t slot = (uint32_t)(k % depth);
                const uint32_t phase = (uint32_t)((k / depth) & 1ull) ^ 1u;
                const kvtier_nvme_sqe* e = &sq[slot];
                const uint32_t dw0 = *(const volatile uint32_t*)e;
                const uint32_t opcode = dw0 & 0xffu;
                const uint32_t cid = dw0 >> 16;
                const uint32_t nlb = (*(const volatile uint32_t*)&e->cdw12 & 0xffffu) + 1u;
                blocks += nlb;
                bad += (opcode != 0x01u && opcode != 0x02u) ? 1u : 0u;
                const uint32_t new_head = (slot + 1u) % depth;
                unsigned long long* c = (unsigned long long*)&cq[slot];
                // dw0/dw1 first, then (sq_head, sq_id, cid, status|phase) in
                // one 8-byte store after a fence: the poller reads the phase
                // tag first, and the word it is in carries cid and sq_head.
                *(volatile unsigned long long*)&c[0] = 0ull;
                __threadfence();
                *(volatile unsigned long long*)&c[1] =
                    (unsigned long long)new_head | ((unsigned long long)qid << 16) |
                    ((unsigned long long)cid << 32) | ((unsigned long long)phase << 48);
            }
            __syncwarp();
            done += n;
            pending -= n;
        }
    }
    // Sum the lanes' counts; lane 0 reports the queue's.
    for (int off = 16; off > 0; off >>= 1) {
        blocks += __shfl_down_sync(0xffffffffu, blocks, off);
        bad += __shfl_down_sync(0xffffffffu, bad, off);
    }
    if (lane == 0) {
        stats[b].commands = done;
        stats[b].blocks = blocks;
        stats[b].bad_opcodes = bad;
    }
}

// kvtier_spin_compute(float* out, uint32_t iters)
//   The compute side of the isolation measurement: every thread runs a
//   dependent FMA chain of `iters` steps and stores its result (so nothing is
//   optimised away). Its time alone, beside the resident I/O kernel on its
//   own SM partition (idle and busy), and with no partition, says how much
//   the I/O kernel takes from compute.
extern "C" __global__ void kvtier_spin_compute(float* __restrict__ out, uint32_t iters) {
    const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
    float a = 1.0f + (float)(i & 7u) * 1e-3f, b = 0.999f, c = 1e-4f;
    float x = a, y = b;
    for (uint32_t k = 0; k < iters; ++k) {
        x = fmaf(x, b, c);
        y = fmaf(y, a, -c);
    }
    out[i] = x + y;
}

// kvtier_stream_copy(const float4* src, float4* dst, uint64_t n)
//   The memory-bound side of the isolation measurement: a grid-stride copy.
extern "C" __global__ void kvtier_stream_copy(const float4* __restrict__ src,
                                              float4* __restrict__ dst, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        dst[i] = src[i];
    }
}

// kvtier_poll_probe(const uint32_t* flag, uint32_t mode, uint32_t sleep_ns,
//                   const uint32_t* stop)
//   What an idle poll loop costs the rest of the GPU: thread 0 of each block
//   polls `flag` (pinned host memory) until *stop, sleeping sleep_ns between
//   polls, with mode 0: ld.acquire.sys (a system-scope fence per poll) or
//   mode 1: ld.relaxed.sys (no fence). Launch on the I/O partition beside a
//   copy kernel on the compute partition.
extern "C" __global__ void kvtier_poll_probe(const uint32_t* __restrict__ flag, uint32_t mode,
                                             uint32_t sleep_ns, const uint32_t* __restrict__ stop) {
    if (threadIdx.x != 0) {
        return;
    }
    uint32_t sink = 0;
    for (uint32_t i = 0;; ++i) {
        uint32_t v;
        if (mode == 0) {
            asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
        } else {
            asm volatile("ld.relaxed.sys.u32 %0, [%1];" : "=r"(v) : "l"(flag) : "memory");
        }
        sink += v;
        if ((i & 15u) == 0 && null_ld_acquire_sys(stop) != 0) {
            break;
        }
        if (sleep_ns) {
            __nanosleep(sleep_ns);
        }
    }
    if (sink == 0xffffffffu) {
        // Never true for a zero flag; keeps the loads.
        *(volatile uint32_t*)stop = sink;
    }
}
