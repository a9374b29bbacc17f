// gio_host.cpp: the I/O kernel's logic (gio_nvme.cuh) built for the host.
//
// build.rs compiles this file with the host C++ compiler (when one is
// found) into a static library linked into the crate: the GPU engine's host
// executor (src/engine/gpu.rs, HostGioExecutor) runs the I/O kernel's logic
// on CPU threads, so the command building, doorbells, CQ polling, timeouts
// and IOCB completion of the CUDA kernel are tested on machines without a
// GPU, against the simulated controller and QEMU's. It uses libc and
// compiler builtins only: no C++ runtime, so static binaries link it.
//
// The entry points compose the same phase functions as kvtier_gio_kernel: a
// block is kvtier_gio_run_block with its threads run as a loop, and a grid
// is one host thread per block (blocks run concurrently on a GPU too).

#include "gio_nvme.cuh"

#include <pthread.h>
#include <stdlib.h>

extern "C" {

// The layout sizes this library was compiled with, so the test can refuse a
// library built against other headers: [queue, ring, dev, engine, iocb].
void kvtier_host_layout(uint64_t out[5]) {
    out[0] = sizeof(kvtier_gio_queue);
    out[1] = sizeof(kvtier_gio_ring);
    out[2] = sizeof(kvtier_gio_dev);
    out[3] = sizeof(kvtier_gio_engine);
    out[4] = sizeof(kvtier_iocb);
}

// One block of kvtier_gio_kernel: block b with nthreads "threads".
void kvtier_host_run_block(const kvtier_gio_engine* eng, uint32_t b, uint32_t nthreads,
                           uint32_t mode) {
    // Heap, as the GPU's shared memory is not the stack either (8 KiB);
    // calloc rather than new: no C++ runtime in this library.
    kvtier_gio_block* sh = (kvtier_gio_block*)calloc(1, sizeof(kvtier_gio_block));
    if (sh == NULL) {
        abort();
    }
    kvtier_gio_run_block(eng, b, nthreads, mode, sh);
    free(sh);
}

struct kvtier_host_block_arg {
    const kvtier_gio_engine* eng;
    uint32_t b, nthreads, mode;
};

static void* kvtier_host_block_main(void* p) {
    const kvtier_host_block_arg* a = (const kvtier_host_block_arg*)p;
    kvtier_host_run_block(a->eng, a->b, a->nthreads, a->mode);
    return NULL;
}

// A launch of kvtier_gio_kernel: eng->queue_count blocks, concurrently, each
// on its own host thread; returns when every block has returned.
void kvtier_host_run_grid(const kvtier_gio_engine* eng, uint32_t nthreads, uint32_t mode) {
    const uint32_t n = eng->queue_count;
    pthread_t* threads = (pthread_t*)calloc(n, sizeof(pthread_t));
    kvtier_host_block_arg* args =
        (kvtier_host_block_arg*)calloc(n, sizeof(kvtier_host_block_arg));
    if (n > 0 && (threads == NULL || args == NULL)) {
        abort();
    }
    for (uint32_t b = 0; b < n; ++b) {
        args[b].eng = eng;
        args[b].b = b;
        args[b].nthreads = nthreads;
        args[b].mode = mode;
        if (pthread_create(&threads[b], NULL, kvtier_host_block_main, &args[b]) != 0) {
            abort();
        }
    }
    for (uint32_t b = 0; b < n; ++b) {
        pthread_join(threads[b], NULL);
    }
    free(args);
    free(threads);
}

// Builds command cmd of IOCTX ctx of IOCB iocb_id for queue q into *sqe and
// the descriptor slot at desc/desc_dma, exactly as the kernel does (after
// the kernel's validation); returns the validation or build status.
uint16_t kvtier_host_build_command(const kvtier_gio_engine* eng, uint32_t q, uint32_t iocb_id,
                                   uint32_t ctx, uint32_t cmd, kvtier_nvme_sqe* sqe,
                                   uint8_t* desc, uint64_t desc_dma, uint32_t* ncmds) {
    const kvtier_gio_queue* queue = kvtier_gio_queue_of(eng, q);
    const kvtier_iocb* iocb = kvtier_gio_iocb(eng, iocb_id);
    const kvtier_ioctx* c = &iocb->ctx[ctx];
    const uint16_t st = kvtier_gio_check(eng, queue, iocb, c, iocb->hdr.seg_count, ncmds);
    if (st != KVTIER_IOCTX_STATUS_OK) {
        return st;
    }
    return kvtier_gio_describe(eng, queue, iocb, c, cmd, sqe, desc, desc_dma, 0);
}

// kvtier_wait_counter's logic: 1 when *counter reached target, 0 on timeout.
int kvtier_host_wait_counter(const uint32_t* counter, uint32_t target, uint64_t timeout_ns) {
    return kvtier_gio_wait(counter, target, timeout_ns);
}

}  // extern "C"
