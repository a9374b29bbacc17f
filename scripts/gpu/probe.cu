// probe.cu: the unknowns of kvtier's GPU path on a new machine, one binary, ~20 s.
// (kvtier copy: steps are named on stdout, line-buffered, and a watchdog names a hung step.)
// Build on the GPU machine: nvcc -O2 -arch=sm_90 -o /tmp/probe probe.cu   (or build it
// elsewhere with -cudart static and take the binary along). One "PROBE key=value" line per figure.
#include <cuda.h>
#include <cuda_runtime.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <thread>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { \
  printf("PROBE error=%s at %s:%d (%s)\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); exit(1);} } while (0)

__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
__device__ __forceinline__ unsigned ld_acq_sys(const unsigned* p) {
  unsigned v; asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v;
}

// 1. %globaltimer: smallest non-zero step, backward steps.
__global__ void k_timer(unsigned long long* out) {
  unsigned long long prev = gtimer(), minstep = ~0ull, back = 0, t0 = prev;
  for (int i = 0; i < 2000000; ++i) {
    unsigned long long t = gtimer();
    if (t < prev) back++;
    else if (t > prev && t - prev < minstep) minstep = t - prev;
    prev = t;
  }
  out[0] = minstep; out[1] = back; out[2] = prev - t0;
}
// 2. system atomics on pinned host memory from many blocks (kvtier's passes/done/cq_reserve).
__global__ void k_atomics(unsigned* host_ctr, unsigned* dev_ctr, int iters) {
  for (int i = 0; i < iters; ++i) { atomicAdd_system(host_ctr, 1u); atomicAdd(dev_ctr, 1u); }
}
// 3. dependent PCIe reads of pinned memory (what every IOCB/CQE read costs the I/O kernel).
__global__ void k_chase(const unsigned* host, int n, unsigned long long* out) {
  unsigned idx = 0; unsigned long long t0 = gtimer();
  for (int i = 0; i < n; ++i) idx = ld_acq_sys(host + idx);
  out[0] = (gtimer() - t0) / n; out[1] = idx;
}
// 4. GPU<->CPU ping-pong through pinned memory (doorbell -> CQE round trip without a device).
__global__ void k_ping(unsigned* ping, unsigned* pong, int n, unsigned long long* out) {
  unsigned long long t0 = gtimer();
  for (int i = 1; i <= n; ++i) {
    __threadfence_system(); *(volatile unsigned*)ping = i;
    while (ld_acq_sys(pong) != (unsigned)i) __nanosleep(32);
  }
  out[0] = (gtimer() - t0) / n;
}
// 5/6. a resident "persistent kernel": spins until *stop (pinned) is set.
__global__ void k_spin(const unsigned* stop) { while (ld_acq_sys(stop) == 0) __nanosleep(256); }
__global__ void k_nop(unsigned* flag, int i) { flag[i] = 1; }
// 7. kernel-written counter (volatile store after a system fence) releasing cuStreamWaitValue32.
__global__ void k_signal(unsigned* ctr, unsigned v, unsigned long long* t) {
  t[0] = gtimer(); __threadfence_system(); *(volatile unsigned*)ctr = v;
}
__global__ void k_stamp(unsigned long long* t) { t[1] = gtimer(); }

typedef CUresult (*WaitFn)(CUstream, CUdeviceptr, cuuint32_t, unsigned);

static double ms_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
}

// Which step is running, for the watchdog: a step that hangs (a host call
// blocked behind a resident kernel, a stream wait never released) is named
// instead of losing the whole run's output.
static std::atomic<const char*> g_step{"start"};
static void step(const char* s) { g_step.store(s); printf("PROBE step=%s\n", s); }

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  int budget_s = getenv("PROBE_BUDGET_S") ? atoi(getenv("PROBE_BUDGET_S")) : 40;
  std::thread([budget_s] { std::this_thread::sleep_for(std::chrono::seconds(budget_s));
    printf("PROBE hang_in=%s after %d s\n", g_step.load(), budget_s); fflush(stdout); _exit(3); }).detach();
  step("init");
  CK(cudaSetDevice(0));
  int natomic = -1, sms = 0; CK(cudaDeviceGetAttribute(&natomic, cudaDevAttrHostNativeAtomicSupported, 0));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  printf("PROBE host_native_atomics=%d sms=%d\n", natomic, sms);
  unsigned long long *o; CK(cudaMallocHost(&o, 64));
  void* dctr0; CK(cudaMalloc(&dctr0, 64));
  step("timer");
  k_timer<<<1, 1>>>(o); CK(cudaDeviceSynchronize());
  printf("PROBE globaltimer_min_step_ns=%llu backward_steps=%llu span_ns=%llu\n", o[0], o[1], o[2]);

  step("pcie_chase");
  const int N = 4096; unsigned* chain; CK(cudaMallocHost(&chain, N * 64 * 4));
  for (int i = 0; i < N; ++i) chain[i * 16] = ((i + 1) % N) * 16;
  k_chase<<<1, 1>>>(chain, N, o); CK(cudaDeviceSynchronize());
  printf("PROBE pcie_dependent_read_ns=%llu\n", o[0]);

  step("pingpong");
  unsigned *ping, *pong; CK(cudaMallocHost(&ping, 64)); CK(cudaMallocHost(&pong, 64)); *ping = *pong = 0;
  std::atomic<bool> done{false};
  std::thread echo([&] { unsigned last = 0; while (!done.load()) {
      unsigned v = __atomic_load_n(ping, __ATOMIC_ACQUIRE);
      if (v != last) { last = v; __atomic_store_n(pong, v, __ATOMIC_RELEASE); } } });
  k_ping<<<1, 1>>>(ping, pong, 20000, o); CK(cudaDeviceSynchronize()); done = true; echo.join();
  printf("PROBE gpu_cpu_pingpong_ns=%llu\n", o[0]);

  // 5. which host calls block while a persistent kernel is resident (another stream):
  // each call gets a fresh spinner released after 1000 ms; ~1000 = it waited for the kernel.
  step("while_resident");
  unsigned* stop; CK(cudaMallocHost(&stop, 4));
  cudaStream_t ss; CK(cudaStreamCreateWithFlags(&ss, cudaStreamNonBlocking));
  auto timed = [&](const char* name, auto fn) {
    *stop = 0; k_spin<<<1, 256, 0, ss>>>(stop);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    std::thread rel([&] { std::this_thread::sleep_for(std::chrono::milliseconds(1000));
                          __atomic_store_n(stop, 1u, __ATOMIC_RELEASE); });
    auto t = std::chrono::steady_clock::now(); fn();
    printf("PROBE while_resident %s_ms=%.1f\n", name, ms_since(t));
    rel.join(); CK(cudaStreamSynchronize(ss));
  };
  void* d = nullptr; std::vector<char> pg(1 << 20); void* ph = nullptr;
  timed("cudaMalloc", [&] { CK(cudaMalloc(&d, 1 << 20)); });
  timed("cudaFree", [&] { CK(cudaFree(d)); });
  timed("cudaMallocHost", [&] { CK(cudaMallocHost(&ph, 1 << 20)); });
  timed("cudaFreeHost", [&] { CK(cudaFreeHost(ph)); });
  timed("cudaHostRegister", [&] { CK(cudaHostRegister(pg.data(), pg.size(), cudaHostRegisterMapped)); });
  timed("cudaHostUnregister", [&] { CK(cudaHostUnregister(pg.data())); });
  timed("cudaMemcpy_sync_4B", [&] { unsigned x = 0; CK(cudaMemcpy(dctr0, &x, 4, cudaMemcpyHostToDevice)); });

  // 6. false dependencies: spinner on stream 0 of 32; a tiny kernel on each other stream.
  step("false_deps");
  *stop = 0; std::vector<cudaStream_t> st(32); unsigned* flags; CK(cudaMallocHost(&flags, 32 * 4));
  for (auto& s : st) CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (int i = 0; i < 32; ++i) flags[i] = 0;
  k_spin<<<1, 256, 0, st[0]>>>(stop);
  for (int i = 1; i < 32; ++i) k_nop<<<1, 1, 0, st[i]>>>(flags, i);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  int ran = 0; for (int i = 1; i < 32; ++i) ran += __atomic_load_n(&flags[i], __ATOMIC_ACQUIRE);
  const char* mc = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  printf("PROBE streams_not_blocked_by_resident_kernel=%d/31 CUDA_DEVICE_MAX_CONNECTIONS=%s\n", ran, mc ? mc : "unset(8)");
  *stop = 1; CK(cudaDeviceSynchronize());

  // 7. cuStreamWaitValue32 released by a kernel's store into pinned memory.
  step("wait_value");
  WaitFn wait = nullptr; cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", (void**)&wait, 12000, cudaEnableDefault, &q));
  unsigned* ctr; CK(cudaMallocHost(&ctr, 4)); *ctr = 0; void* dctr; CK(cudaHostGetDevicePointer(&dctr, ctr, 0));
  cudaStream_t sw, sk; CK(cudaStreamCreateWithFlags(&sw, cudaStreamNonBlocking)); CK(cudaStreamCreateWithFlags(&sk, cudaStreamNonBlocking));
  double best = 1e30;
  for (unsigned r = 1; r <= 50; ++r) {
    CUresult cr = wait((CUstream)sw, (CUdeviceptr)dctr, r, CU_STREAM_WAIT_VALUE_GEQ);
    if (cr != CUDA_SUCCESS) { printf("PROBE cuStreamWaitValue32 failed=%d\n", (int)cr); break; }
    k_stamp<<<1, 1, 0, sw>>>(o);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    k_signal<<<1, 1, 0, sk>>>(ctr, r, o);
    CK(cudaStreamSynchronize(sw));
    double ns = (double)(o[1] - o[0]); if (ns < best) best = ns;
  }
  printf("PROBE wait_value_release_ns_min=%.0f\n", best);
  step("sys_atomics");
  unsigned *hc, *dc; CK(cudaMallocHost(&hc, 4)); CK(cudaMalloc(&dc, 4)); *hc = 0; CK(cudaMemset(dc, 0, 4));
  k_atomics<<<sms, 256>>>(hc, dc, 16); CK(cudaDeviceSynchronize());
  unsigned dv; CK(cudaMemcpy(&dv, dc, 4, cudaMemcpyDeviceToHost));
  printf("PROBE sys_atomics_on_pinned=%u expected=%u device_atomics=%u\n", *hc, sms * 256u * 16u, dv);

  printf("PROBE done\n");
  return 0;
}
