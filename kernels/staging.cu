// staging.cu: copies between a pinned staging area and paged KV blocks in HBM.
//
// The staged HBM path (no GPUDirect needed): a layer's reads land in pinned
// host staging in the pool's coalesced order, and one launch scatters them
// into the engine's paged KV blocks; a store gathers blocks from HBM into
// staging and computes each object's crc32c on the way, so blocks stored
// from GPU memory carry a data checksum like any other.
//
// kvtier_scatter(const kvtier_copy* list, uint32_t n)
//   Copy list[i].len bytes from list[i].src to list[i].dst for every i < n.
//   Any grid; blocks stride over the list, a block's threads over one copy.
// kvtier_gather_crc32c(const kvtier_copy* list, uint32_t n, uint32_t* crc)
//   The same copies, and crc[i] = crc32c (Castagnoli, as the pool's block
//   headers and the `crc32c` crate compute it) of copy i's bytes. Launch with
//   KVTIER_STAGING_THREADS threads per block.
//
// Addresses are unified virtual addresses: device pointers, or the device
// view of pinned/registered host memory. Copies whose src, dst and len are
// all 16-byte aligned move 16 bytes per thread access (KV objects are
// multiples of 4 KiB); others fall back to bytes.

#include <stdint.h>

#define KVTIER_STAGING_THREADS 256
#define KVTIER_CRC32C_POLY 0x82F63B78u /* reflected Castagnoli */

typedef struct kvtier_copy {
    uint64_t src;
    uint64_t dst;
    uint32_t len;
    uint32_t reserved;
} kvtier_copy;

static_assert(sizeof(kvtier_copy) == 24, "kvtier_copy size");
static_assert(__builtin_offsetof(kvtier_copy, len) == 16, "kvtier_copy.len");

static __device__ __forceinline__ int staging_aligned16(const kvtier_copy* c) {
    return ((c->src | c->dst | (uint64_t)c->len) & 15u) == 0;
}

static __device__ __forceinline__ void staging_copy(const kvtier_copy* c) {
    if (staging_aligned16(c)) {
        const uint4* s = (const uint4*)(uintptr_t)c->src;
        uint4* d = (uint4*)(uintptr_t)c->dst;
        const uint32_t n = c->len / 16u;
        for (uint32_t k = threadIdx.x; k < n; k += blockDim.x) {
            d[k] = s[k];
        }
    } else {
        const uint8_t* s = (const uint8_t*)(uintptr_t)c->src;
        uint8_t* d = (uint8_t*)(uintptr_t)c->dst;
        for (uint32_t k = threadIdx.x; k < c->len; k += blockDim.x) {
            d[k] = s[k];
        }
    }
}

extern "C" __global__ void kvtier_scatter(const kvtier_copy* __restrict__ list, uint32_t n) {
    for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
        staging_copy(&list[i]);
    }
}

/* ---------------------------------------------------------- crc32c -- */

/* a * b modulo the CRC polynomial, both in the reflected representation
 * (bit 31 is x^0): what appending zero bytes does to a CRC is a
 * multiplication by x^(8n), which is how partial CRCs combine. */
static __device__ uint32_t crc32c_mulmod(uint32_t a, uint32_t b) {
    uint32_t p = 0;
    for (int i = 0; i < 32; ++i) {
        if (a & 0x80000000u) {
            p ^= b;
        }
        a <<= 1;
        b = (b & 1u) ? (b >> 1) ^ KVTIER_CRC32C_POLY : b >> 1;
    }
    return p;
}

/* x^(8 * bytes) modulo the polynomial (reflected). */
static __device__ uint32_t crc32c_x8n(uint64_t bytes) {
    uint32_t r = 0x80000000u;            /* x^0 */
    uint32_t base = 0x80000000u >> 8;    /* x^8 */
    while (bytes) {
        if (bytes & 1u) {
            r = crc32c_mulmod(r, base);
        }
        base = crc32c_mulmod(base, base);
        bytes >>= 1;
    }
    return r;
}

/* crc32c(A || B) from crc32c(A), crc32c(B) and |B| (with the usual initial
 * and final inversion, which the combination preserves). */
static __device__ __forceinline__ uint32_t crc32c_combine(uint32_t a, uint32_t b,
                                                          uint32_t shift_b) {
    return crc32c_mulmod(shift_b, a) ^ b;
}

extern "C" __global__ void __launch_bounds__(KVTIER_STAGING_THREADS)
    kvtier_gather_crc32c(const kvtier_copy* __restrict__ list, uint32_t n,
                         uint32_t* __restrict__ crc_out) {
    __shared__ uint32_t table[256];
    __shared__ uint32_t part[KVTIER_STAGING_THREADS];
    __shared__ uint32_t shift[9];
    for (uint32_t k = threadIdx.x; k < 256; k += blockDim.x) {
        uint32_t c = k;
        for (int j = 0; j < 8; ++j) {
            c = (c & 1u) ? (c >> 1) ^ KVTIER_CRC32C_POLY : c >> 1;
        }
        table[k] = c;
    }
    __syncthreads();
    const uint32_t t = threadIdx.x, nt = blockDim.x;
    for (uint32_t i = blockIdx.x; i < n; i += gridDim.x) {
        const kvtier_copy* c = &list[i];
        staging_copy(c);
        // Thread t checksums bytes [t*chunk, (t+1)*chunk) of the copy's
        // source (the last thread also takes the remainder), reading it
        // again: it is in L2 after the copy.
        const uint32_t chunk = c->len / nt;
        const uint32_t lo = t * chunk;
        const uint32_t hi = (t == nt - 1) ? c->len : lo + chunk;
        const uint8_t* s = (const uint8_t*)(uintptr_t)c->src;
        uint32_t crc = 0xFFFFFFFFu;
        if (staging_aligned16(c) && ((hi - lo) & 15u) == 0) {
            const uint4* v = (const uint4*)(s + lo);
            for (uint32_t k = 0; k < (hi - lo) / 16u; ++k) {
                const uint4 w = v[k];
                const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    uint32_t x = words[q];
#pragma unroll
                    for (int byte = 0; byte < 4; ++byte) {
                        crc = table[(crc ^ x) & 0xffu] ^ (crc >> 8);
                        x >>= 8;
                    }
                }
            }
        } else {
            for (uint32_t k = lo; k < hi; ++k) {
                crc = table[(crc ^ s[k]) & 0xffu] ^ (crc >> 8);
            }
        }
        part[t] = crc ^ 0xFFFFFFFFu;
        // Shift operators for the tree: level l joins two runs of
        // chunk * 2^l bytes (the right one of the last pair may be longer:
        // it carries the remainder, handled below by its own shift).
        if (t < 9) {
            shift[t] = crc32c_x8n((uint64_t)chunk << t);
        }
        __syncthreads();
        // Tree combine: at level l, thread t (a multiple of 2^(l+1)) joins
        // its run with the run starting at t + 2^l.
        for (uint32_t l = 0; (1u << l) < nt; ++l) {
            const uint32_t step = 1u << l;
            uint32_t joined = 0;
            const int active = (t % (2u * step)) == 0 && t + step < nt;
            if (active) {
                // Bytes in the right run: step chunks, plus the remainder
                // if it ends with the last thread.
                const uint32_t right_end = t + 2u * step >= nt ? c->len : (t + 2u * step) * chunk;
                const uint32_t right_len = right_end - (t + step) * chunk;
                const uint32_t sh = right_len == (chunk << l) && l < 9 ? shift[l]
                                                                        : crc32c_x8n(right_len);
                joined = crc32c_combine(part[t], part[t + step], sh);
            }
            __syncthreads();
            if (active) {
                part[t] = joined;
            }
            __syncthreads();
        }
        if (t == 0) {
            crc_out[i] = part[0];
        }
        __syncthreads();
    }
}
