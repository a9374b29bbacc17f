// abi_check.cu: device-side validation of a completed IOCB.
//
// Two purposes. First, it is the CUDA translation unit that proves
// kvtier_abi.h compiles under nvcc (the header's static_asserts run in both
// the host and the device compilation passes), so build.rs catches a header
// that C and C++ accept but CUDA does not. Second, the GPU engine uses these
// kernels to check an IOCB where it lives, in GPU-visible memory, without
// copying 128 KiB back to the host: after the I/O kernel marks an IOCB
// COMPLETE, one launch tells the host whether hdr.errors is right and which
// IOCTXs failed.
//
// Both kernels only read the IOCB, so they may run while the host polls it.
// Launch with any grid and block size: they use grid-stride loops, and one
// block of 256 threads covers a full IOCB (2048 IOCTXs) in 8 iterations.

#include "kvtier_abi.h"

// Clamp a count read from memory the host (or a buggy kernel) wrote, so that a
// corrupt header never makes a validation kernel read past the IOCB.
__device__ __forceinline__ uint32_t kvtier_clamp_count(uint32_t count) {
    return count < KVTIER_IOCB_MAX_IOCTX ? count : KVTIER_IOCB_MAX_IOCTX;
}

// Counts the IOCTXs in ctx[0 .. hdr.count) whose status is not
// KVTIER_IOCTX_STATUS_OK, adding the count to *out (the caller zeroes it).
// After a completed IOCB the result must equal hdr.errors; a mismatch means
// the engine's completion accounting is wrong.
//
// Each thread counts privately and a warp reduces before one atomicAdd per
// warp, so a full IOCB costs 2048 / 32 = 64 atomics rather than one per error.
extern "C" __global__ void kvtier_iocb_count_errors(const kvtier_iocb* __restrict__ iocb,
                                                    uint32_t* __restrict__ out) {
    const uint32_t count = kvtier_clamp_count(iocb->hdr.count);
    const uint32_t stride = gridDim.x * blockDim.x;

    uint32_t errors = 0;
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        if (iocb->ctx[i].status != KVTIER_IOCTX_STATUS_OK) {
            ++errors;
        }
    }

    // A block whose size is not a multiple of 32 has a partial last warp, for
    // which a full-mask shuffle is undefined: count per thread instead. The
    // test is uniform across the block, so no warp diverges on it.
    if ((blockDim.x & 31u) != 0) {
        if (errors != 0) {
            atomicAdd(out, errors);
        }
        return;
    }

    // Warp-level sum: every lane takes part (no early exit above), so the full
    // mask is valid even when count is not a multiple of 32.
    for (int offset = 16; offset > 0; offset >>= 1) {
        errors += __shfl_down_sync(0xffffffffu, errors, offset);
    }
    if ((threadIdx.x & 31u) == 0 && errors != 0) {
        atomicAdd(out, errors);
    }
}

// Writes the indices of IOCTXs with a non-zero status into failed[], which
// holds `capacity` entries, and the number of failed IOCTXs into *n_failed
// (the caller zeroes it). When more IOCTXs failed than fit, *n_failed still
// counts them all and only the first `capacity` claimed slots are written, so
// the host knows the list is truncated. The order of indices is unspecified.
extern "C" __global__ void kvtier_iocb_list_errors(const kvtier_iocb* __restrict__ iocb,
                                                   uint32_t* __restrict__ failed,
                                                   uint32_t capacity,
                                                   uint32_t* __restrict__ n_failed) {
    const uint32_t count = kvtier_clamp_count(iocb->hdr.count);
    const uint32_t stride = gridDim.x * blockDim.x;

    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
        if (iocb->ctx[i].status != KVTIER_IOCTX_STATUS_OK) {
            const uint32_t slot = atomicAdd(n_failed, 1u);
            if (slot < capacity) {
                failed[slot] = i;
            }
        }
    }
}
