// gio_kernel.cu: the GPU engine's I/O kernel and its wait kernel.
//
// kvtier_gio_kernel(const kvtier_gio_engine* eng, uint32_t mode)
//   Launch with gridDim.x = eng->queue_count (block b owns queues[b]) and
//   blockDim.x = KVTIER_GIO_BLOCK_THREADS, on the I/O green context's SM
//   partition. mode KVTIER_GIO_MODE_ONESHOT processes the IOCBs in the gio
//   SQ when it starts and exits (one launch per layer's IOCBs, after the
//   host stored the ids and the SQ tail); KVTIER_GIO_MODE_PERSISTENT stays
//   resident, taking IOCBs as the host publishes them, until ring->stop is
//   set and the SQ is drained. The logic is kernels/gio_nvme.cuh, shared
//   with the host-run test (kernels/host/gio_host.cpp).
//
// Waiting for IOCBs: the ring's completion counter (kvtier_gio_ring.completed)
// advances by one per completed IOCB, after its CQ entry and IOCTX statuses
// are visible. The engine makes the compute stream wait for "n IOCBs done"
// with cuStreamWaitValue32(stream, &ring->completed, n,
// CU_STREAM_WAIT_VALUE_GEQ), which costs no SM. kvtier_wait_counter is the
// fallback where a stream memory op does not fit (a driver without stream
// memory operations, or a wait that must sit inside a graph of kernels): one
// thread spins on the counter.

#include "gio_nvme.cuh"

extern "C" __global__ void __launch_bounds__(KVTIER_GIO_BLOCK_THREADS)
    kvtier_gio_kernel(const kvtier_gio_engine* __restrict__ eng, uint32_t mode) {
    __shared__ kvtier_gio_block sh;
    kvtier_gio_run_block(eng, blockIdx.x, blockDim.x, mode, &sh);
}

// kvtier_wait_counter(const uint32_t* counter, uint32_t target,
//                     uint64_t timeout_ns, uint32_t* timed_out)
//   Launch <<<1, 1>>> on the stream that must wait. Returns when *counter
//   has reached target (wrap-safe, as CU_STREAM_WAIT_VALUE_GEQ compares), or
//   after timeout_ns (0: no limit), then sets *timed_out (if not NULL) to 1,
//   so a hung device shows up as an error on the host rather than a hang.
extern "C" __global__ void kvtier_wait_counter(const uint32_t* __restrict__ counter,
                                               uint32_t target, uint64_t timeout_ns,
                                               uint32_t* __restrict__ timed_out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) {
        return;
    }
    // The fence at the end of kvtier_gio_wait: later work on the stream
    // reads what the I/O kernel wrote before the counter (IOCTX statuses,
    // the KV bytes the device DMAed).
    if (!kvtier_gio_wait(counter, target, timeout_ns) && timed_out) {
        *timed_out = 1u;
    }
}
