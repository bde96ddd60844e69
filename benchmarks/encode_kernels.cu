// Encode-kernel variants side by side (issue 22, item 6): the default syndrome_mix kernel against
// pipelines that wait on mbarriers instead of a CTA-wide __syncthreads per stage and other stage
// sizes, on the default group (1024 pages of 2 MiB, 16 parity pages).  A standalone binary (no torch), so a GPU machine
// runs it without building the extension first.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -diag-suppress 128 -Icuda \
//        -o /tmp/encode_kernels \
//        benchmarks/encode_kernels.cu && /tmp/encode_kernels [reps]
//
// Every variant's output is checked bit for bit against an independent host computation of the
// same code (Horner over the pages per exponent, then the mix with the compiled-in matrix) at
// 4096 sampled symbols of every parity page, and compared in full against the default kernel's
// output (which tests/gpu/test_parity_cuda.py checks against the Python reference).  Prints one
// line per variant: ms, TB/s, % of a device-to-device copy of the same bytes, check results.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "parity_cuda_kernels.cuh"

namespace {

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives on `bar` once every cp.async this thread issued before has landed.
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred P1;\n"
      "WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      " @!P1 bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// A Cfg whose pipeline waits on mbarriers: full[b] completes when every thread's copies of the
// stage in buffer b have landed (cp.async arrive, one per thread), empty[b] when every warp has
// read it.  Copies run kNS - 2 stages ahead, so a thread refilling a buffer waits only for the
// warps still on the stage before last (a CTA-wide barrier waits for the slowest warp each stage).
template <int NB_, int KP_, int NS_>
struct CfgM : Cfg<NB_, KP_, NS_, true, true, true, true> {
  using Base = Cfg<NB_, KP_, NS_, true, true, true, true>;
  static_assert(NS_ >= 3, "copies run kNS - 2 stages ahead");
  static constexpr int kBarOff = Base::kPipeBytes > Base::kSynBytes ? Base::kPipeBytes : Base::kSynBytes;
  static constexpr int kSmem = kBarOff + 2 * NS_ * 8;
};

template <class C, int GI, bool kCompute>
__device__ __forceinline__ void page_loop_mbar(const SyndromeArgs& a, uint8_t* smem, uint32_t (&acc)[4][16]) {
  constexpr int NB = C::NB, kNS = C::kNS, kD = C::kNS - 2;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kBarOff);
  uint64_t* empty = full + kNS;
  const int tid = threadIdx.x;
  const int col = thread_col();
  const int bl = col / 16, q = col % 16;
  const size_t tile_off = static_cast<size_t>(tile_index<C>()) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / C::kP;
  const int cbl = tid / 64, cch = tid % 64;
  const bool cvalid = tile_index<C>() * NB + cbl < blocks;
  const size_t csrc = tile_off + static_cast<size_t>(cbl) * 1024 + cch * 16;
  const int cdst = cbl * C::kBlockStride + cch * 16;
  if (tid == 0) {
    for (int b = 0; b < kNS; ++b) {
      mbar_init(full + b, C::kThreads);
      mbar_init(empty + b, C::kThreads / 32);
    }
  }
  __syncthreads();
  auto issue = [&](int s) {  // stage s into buffer s % kNS; every thread arrives on full
    const int buf = s % kNS;
    uint8_t* st = smem + buf * C::kStageBytes + cdst;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = n_pad - 1 - (s * C::kP + p);
      const uint8_t* src = (j < a.n && cvalid) ? a.pages[j] : nullptr;
      cp_async16_z(st + p * C::kPageSmem, src ? static_cast<const void*>(src + csrc) : a.pages, src ? 16u : 0u);
    }
    mbar_arrive_cp_async(full + buf);
  };
  for (int s = 0; s < kD && s < n_stages; ++s) issue(s);
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    const int sn = s + kD;
    if (sn < n_stages) {
      if (sn >= kNS) mbar_wait(empty + sn % kNS, ((sn / kNS) - 1) & 1);
      issue(sn);
    }
    mbar_wait(full + s % kNS, (s / kNS) & 1);
    if constexpr (kCompute) {
      const uint8_t* st = smem + (s % kNS) * C::kStageBytes + bl * C::kBlockStride + q * 4;
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        uint32_t d[16];
#pragma unroll
        for (int r = 0; r < 16; ++r) d[r] = *reinterpret_cast<const uint32_t*>(st + p * C::kPageSmem + r * 64);
        group_step<GI>(acc, d);
      }
    }
    __syncwarp();
    if ((tid & 31) == 0) mbar_arrive(empty + s % kNS);
  }
  __syncthreads();  // every stage consumed (so every copy landed); smem free for the exchange
}

template <class C, int GI>
__device__ __forceinline__ void run_group_mbar(const SyndromeArgs& a, const MixMasks& masks, uint8_t* smem) {
  run_group_with<C, GI>(a, masks, smem, [&](uint32_t (&acc)[4][16]) {
    if ((a.group_mask >> GI) & 1u) page_loop_mbar<C, GI, true>(a, smem, acc);
    else page_loop_mbar<C, GI, false>(a, smem, acc);
  });
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    syndrome_mix_mbar_kernel(const SyndromeArgs a, const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  switch (thread_group()) {
    case 0: run_group_mbar<C, 0>(a, masks, smem); break;
    case 1: run_group_mbar<C, 1>(a, masks, smem); break;
    case 2: run_group_mbar<C, 2>(a, masks, smem); break;
    default: run_group_mbar<C, 3>(a, masks, smem); break;
  }
}

template <class C>
void launch_mbar(const SyndromeArgs& a, const MixMasks& masks, cudaStream_t stream) {
  auto kern = syndrome_mix_mbar_kernel<C>;
  check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem), "attr");
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  kern<<<dim3((blocks + C::NB - 1) / C::NB, 1), C::kThreads, C::kSmem, stream>>>(a, masks);
  check(cudaGetLastError(), "launch");
}

// ---- host reference of one symbol ------------------------------------------------------------
uint16_t symbol(const uint8_t* page, size_t blk, int q, int bit) {
  uint16_t s = 0;
  for (int r = 0; r < 16; ++r) {
    uint32_t w;
    std::memcpy(&w, page + blk * 1024 + r * 64 + q * 4, 4);
    s |= static_cast<uint16_t>(((w >> bit) & 1u) << r);
  }
  return s;
}

struct Variant {
  const char* name;
  void (*launch)(const SyndromeArgs&, const MixMasks&, cudaStream_t);
};

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  constexpr int D = 1024, M = 16;
  constexpr size_t S = size_t(2) << 20;
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "props");
  std::printf("GPU: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  uint8_t* data = nullptr;
  uint8_t* par = nullptr;
  uint8_t* ref = nullptr;
  check(cudaMalloc(&data, D * S), "malloc data");
  check(cudaMalloc(&par, M * S), "malloc par");
  check(cudaMalloc(&ref, M * S), "malloc ref");
  std::vector<uint8_t> host(D * S);
  std::mt19937_64 rng(12345);
  for (size_t i = 0; i < host.size(); i += 8) {
    const uint64_t v = rng();
    std::memcpy(host.data() + i, &v, 8);
  }
  check(cudaMemcpy(data, host.data(), D * S, cudaMemcpyHostToDevice), "h2d");
  std::vector<const uint8_t*> hp(D);
  std::vector<uint8_t*> ho(M), hr(M);
  for (int j = 0; j < D; ++j) hp[j] = data + j * S;
  for (int i = 0; i < M; ++i) ho[i] = par + i * S, hr[i] = ref + i * S;
  const uint8_t** dp = nullptr;
  uint8_t** dout = nullptr;
  uint8_t** dref = nullptr;
  check(cudaMalloc(&dp, D * 8), "m");
  check(cudaMalloc(&dout, M * 8), "m");
  check(cudaMalloc(&dref, M * 8), "m");
  check(cudaMemcpy(dp, hp.data(), D * 8, cudaMemcpyHostToDevice), "c");
  check(cudaMemcpy(dout, ho.data(), M * 8, cudaMemcpyHostToDevice), "c");
  check(cudaMemcpy(dref, hr.data(), M * 8, cudaMemcpyHostToDevice), "c");

  uint16_t coef[M * 16];
  for (int i = 0; i < M; ++i)
    for (int t = 0; t < 16; ++t) coef[i * 16 + t] = static_cast<uint16_t>(leto_gf::baked_coef(i, t));
  SyndromeArgs a{};
  a.pages = dp;
  a.n = D;
  a.m_out = M;
  a.page_bytes = static_cast<int64_t>(S);
  a.batch = 1;
  MixMasks masks{};
  if (!prepare_mix(a, coef, masks)) { std::printf("not baked\n"); return 1; }

  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  auto time_it = [&](auto&& fn) {
    fn();
    check(cudaDeviceSynchronize(), "warm");
    cudaEventRecord(e0);
    for (int r = 0; r < reps; ++r) fn();
    cudaEventRecord(e1);
    check(cudaEventSynchronize(e1), "sync");
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    return ms / reps;
  };
  uint8_t* cp = nullptr;
  check(cudaMalloc(&cp, D * S), "malloc copy");
  const float copy_ms = time_it([&] { cudaMemcpyAsync(cp, data, D * S, cudaMemcpyDeviceToDevice); });
  check(cudaFree(cp), "free");
  std::printf("d2d copy of 2 GiB: %.3f ms, %.2f TB/s\n", copy_ms, D * S / copy_ms / 1e9);

  // Host reference at sampled symbols: S_t by Horner from the top page, then the baked mix.
  constexpr int kSamples = 4096;
  std::vector<size_t> sb(kSamples);
  std::vector<int> sq(kSamples), sbit(kSamples);
  std::vector<uint16_t> want(kSamples * M);
  uint32_t xt[16];
  for (int ti = 0; ti < 16; ++ti) xt[ti] = leto_gf::xpow(ti + leto_gf::kTLo);
  for (int k = 0; k < kSamples; ++k) {
    sb[k] = rng() % (S / 1024), sq[k] = static_cast<int>(rng() % 16), sbit[k] = static_cast<int>(rng() % 32);
    uint32_t syn[16] = {};
    for (int j = D - 1; j >= 0; --j) {
      const uint16_t v = symbol(host.data() + j * S, sb[k], sq[k], sbit[k]);
      for (int ti = 0; ti < 16; ++ti) syn[ti] = leto_gf::gf_mul(syn[ti], xt[ti]) ^ v;
    }
    for (int i = 0; i < M; ++i) {
      uint32_t o = 0;
      for (int ti = 0; ti < 16; ++ti) o ^= leto_gf::gf_mul(leto_gf::baked_coef(i, ti), syn[ti]);
      want[k * M + i] = static_cast<uint16_t>(o);
    }
  }

  const Variant variants[] = {
      {"auto (default)", launch_sm<CfgAuto<true>>},
      {"plain", launch_sm<CfgPlain<true>>},
      {"kp2 ns8", launch_sm<Cfg<4, 2, 8, true, true, true, true>>},
      {"kp8 ns3", launch_sm<Cfg<4, 8, 3, true, true, true, true>>},
      {"mbar kp4 ns4", launch_mbar<CfgM<4, 4, 4>>},
      {"mbar kp4 ns5", launch_mbar<CfgM<4, 4, 5>>},
      {"mbar kp2 ns6", launch_mbar<CfgM<4, 2, 6>>},
      {"mbar kp2 ns8", launch_mbar<CfgM<4, 2, 8>>},
      {"mbar kp1 ns10", launch_mbar<CfgM<4, 1, 10>>},
  };
  std::vector<uint8_t> got(M * S), base(M * S);
  bool all_ok = true;
  for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); ++v) {
    check(cudaMemset(par, 0xA5, M * S), "memset");
    SyndromeArgs av = a;
    av.outs = dout;
    variants[v].launch(av, masks, nullptr);
    check(cudaDeviceSynchronize(), variants[v].name);
    check(cudaMemcpy(got.data(), par, M * S, cudaMemcpyDeviceToHost), "d2h");
    int bad = 0;
    for (int k = 0; k < kSamples; ++k)
      for (int i = 0; i < M; ++i)
        bad += symbol(got.data() + i * S, sb[k], sq[k], sbit[k]) != want[k * M + i];
    if (v == 0) base = got;
    const bool same = got == base;
    const float ms = time_it([&] { variants[v].launch(av, masks, nullptr); });
    const double tbps = D * S / ms / 1e9;
    std::printf("%-18s %7.3f ms  %5.2f TB/s  %3.0f%% of copy  sampled-symbol mismatches %d  %s\n",
                variants[v].name, ms, tbps, 100.0 * copy_ms / ms, bad,
                same ? "identical to default" : "DIFFERS from default");
    all_ok = all_ok && bad == 0 && same;
  }
  std::printf(all_ok ? "all variants exact\n" : "MISMATCH\n");
  return all_ok ? 0 : 1;
}
