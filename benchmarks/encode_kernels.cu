// Encode-kernel variants side by side (issue 22, item 6): the default syndrome_mix kernel against
// pipelines that wait on mbarriers instead of a CTA-wide __syncthreads per stage, other stage
// sizes, and 8 thread groups of 2 syndromes (fewer registers, more warps per SM), on the default
// group (1024 pages of 2 MiB, 16 parity pages).  A standalone binary (no torch), so a GPU machine
// runs it without building the extension first.
//
//   nvcc -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr -Icuda -o /tmp/encode_kernels \
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

// ---- 8 thread groups of 2 syndromes ------------------------------------------------------------
// The default keeps 4 syndromes (64 accumulator registers) per thread: 128 registers, 16 warps per
// SM, 4 per scheduler, too few to hide the LOP3 chains' fixed latency and the stage barrier.  Here
// 8 groups keep 2 each (acc[2][16]), so a thread fits in 64..80 registers and an SM holds 24..32
// warps.  The price: each page word is read from shared memory by 8 groups instead of 4.  Per 4 KB
// page of an NB=4 tile an SM then spends ~256 + 32 (copy) shared-memory wavefronts against ~290
// cycles of LOP3s on its ALU pipes: both near 76% at 2.5 TB/s (~380 cycles a page-tile).

// The 16 exponents in pairs.  Sub-partition k runs groups k and k+4 (warp w: group w % 8, on
// sub-partition w % 4), so the pairs balance first the sub-partition's total, then the single
// groups.  Costs are LOP3s per 4 pages as nvcc emits them for one exponent in a rolled 4-page loop
// (it merges XORs across pages: t=0 costs 32, t=-7 115; 288 per page for all 16): sub-partitions
// 278, 278, 278, 277 (the 4-group split's 287, 279, 278, 267); groups 147, 141, 138, 139 | 131,
// 137, 140, 138 (t=-7 cannot pair below 115 + 32).
__host__ __device__ constexpr int g8_t(int g, int k) {
  constexpr int kT[8][2] = {{-7, 0}, {-6, 1}, {-5, -2}, {2, 7}, {-3, 5}, {-4, 4}, {-1, 8}, {3, 6}};
  return kT[g][k];
}
constexpr bool g8_covers_all() {
  unsigned seen = 0;
  for (int g = 0; g < 8; ++g)
    for (int k = 0; k < 2; ++k) seen |= 1u << (g8_t(g, k) - leto_gf::kTLo);
  return seen == 0xFFFFu;
}
static_assert(g8_covers_all(), "every exponent t=-7..8 in exactly one group");

// NB blocks per tile (16*NB columns, 8 groups: 128*NB threads); KP pages per stage, NS stages
// (the default's zero-fill rolled pipeline); MINB CTAs per SM asked of the register allocator
// (65536 / (threads * MINB) registers per thread: NB=2: 3 -> 80, 4 -> 64; NB=4: 2 -> 64).
template <int NB_, int KP_, int NS_, int MINB_>
struct CfgG8 {
  static constexpr int NB = NB_, kP = KP_, kNS = NS_, kMinBlocks = MINB_;
  static constexpr bool kTileY = false;
  static_assert(NB == 2 || NB == 4, "a warp must hold 32 columns of one group");
  static_assert(kNS >= 2, "one stage computed while the next lands");
  static constexpr int kCols = 16 * NB;
  static constexpr int kThreads = 8 * kCols;
  static constexpr int kChunks = 64 * NB;                // 16-byte chunks of one page of the tile
  static constexpr int kCopyPages = kThreads / kChunks;  // pages copied by one pass of all threads
  static_assert(16 % kP == 0 && kP % kCopyPages == 0, "n_pad = 16k splits into stages; whole passes");
  static constexpr int kBlockStride = 1024 + 64;         // as Cfg: +16 banks per block
  static constexpr int kPageSmem = NB * kBlockStride;
  static constexpr int kStageBytes = kP * kPageSmem;
  static constexpr int kPipeBytes = kNS * kStageBytes;
  static constexpr int kSynBytes = 256 * kCols * 4;
  static constexpr int kSmem = kPipeBytes > kSynBytes ? kPipeBytes : kSynBytes;
  // H100: 228 KB of shared memory per SM, 1 KB of it reserved per CTA; 64 warps per SM.
  static_assert(kMinBlocks * (kSmem + 1024) <= 228 * 1024, "MINB CTAs must fit in shared memory");
  static_assert(kMinBlocks * kThreads <= 1024, "at least 64 registers per thread");
};

__device__ __forceinline__ int g8_group() { return (threadIdx.x / 32) % 8; }
__device__ __forceinline__ int g8_col() { return (threadIdx.x / 256) * 32 + threadIdx.x % 32; }
// The column read anew from %tid.x after the page loop: otherwise nvcc keeps the epilogue's
// column values live across the loop and, at 64 registers, spills them.
__device__ __forceinline__ int g8_col_fresh() {
  unsigned t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return static_cast<int>((t / 256) * 32 + t % 32);
}

template <int GI>
__device__ __forceinline__ void g8_step(uint32_t (&acc)[2][16], const uint32_t (&d)[16]) {
  static_for<2>([&](auto k) { leto_gf::horner_step<g8_t(GI, LETO_CV(k)), true>(acc[LETO_CV(k)], d); });
}

// The default's zero-fill rolled pipeline (page_loop, kZfill), with the copy duty of a stage spread
// over twice as many threads: thread tid copies chunk tid % kChunks of pages tid / kChunks + i *
// kCopyPages (a warp copies 512 contiguous bytes of one page; every chunk exactly once).
template <class C, int GI>
__device__ __forceinline__ void page_loop_g8(const SyndromeArgs& a, uint8_t* smem, uint32_t (&acc)[2][16]) {
  constexpr int NB = C::NB, kP = C::kP, kNS = C::kNS, kCP = C::kCopyPages, kMine = kP / kCP;
  const int tid = threadIdx.x;
  const int col = g8_col();
  const int bl = col / 16, q = col % 16;
  const int tile = tile_index<C>();
  const size_t tile_off = static_cast<size_t>(tile) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / kP;
  const int cc = tid % C::kChunks, cp0 = tid / C::kChunks;
  const int cbl = cc / 64, cch = cc % 64;
  // Few live registers beside the 32 accumulators (64-register configs): the chunk's offset in a
  // page in 32 bits (the launcher checks page_bytes < 4 GiB), and one compare per page: copy i of
  // stage s is page j = jt - s*kP - i*kCP, and 0 <= j < nv holds iff s < n_stages, j < n and the
  // chunk lies in the page (nv = 0 otherwise: zero fill).
  const uint32_t csrc = static_cast<uint32_t>(tile_off) + cbl * 1024u + cch * 16u;
  const int cdst = cp0 * C::kPageSmem + cbl * C::kBlockStride + cch * 16;
  const int jt = n_pad - 1 - cp0;
  const unsigned nv = tile * NB + cbl < blocks ? static_cast<unsigned>(a.n) : 0u;
  const uint8_t* nxt[kMine];
  auto fetch = [&](int s) {  // page addresses one stage ahead, as kZfill
#pragma unroll
    for (int i = 0; i < kMine; ++i) {
      const int j = jt - s * kP - i * kCP;
      nxt[i] = static_cast<unsigned>(j) < nv ? a.pages[j] : nullptr;
    }
  };
  auto issue = [&](int s, int buf) {
    if (s < n_stages) {
      uint8_t* st = smem + buf * C::kStageBytes + cdst;
#pragma unroll
      for (int i = 0; i < kMine; ++i) {
        const uint8_t* src = nxt[i];
        cp_async16_z(st + i * kCP * C::kPageSmem, src ? static_cast<const void*>(src + csrc) : a.pages,
                     src ? 16u : 0u);
      }
    }
    cp_async_commit();  // always, so that group counting stays uniform
  };
#pragma unroll
  for (int s = 0; s < kNS - 1; ++s) {
    fetch(s);
    issue(s, s);
  }
  fetch(kNS - 1);
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<kNS - 2>();
    __syncthreads();  // stage s visible to all; everyone is done with stage s-1's buffer
    issue(s + kNS - 1, (s + kNS - 1) % kNS);
    fetch(s + kNS);
    const uint8_t* st = smem + (s % kNS) * C::kStageBytes + bl * C::kBlockStride + q * 4;
#pragma unroll
    for (int p = 0; p < kP; ++p) {
      uint32_t d[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) d[r] = *reinterpret_cast<const uint32_t*>(st + p * C::kPageSmem + r * 64);
      g8_step<GI>(acc, d);
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // pipeline drained; smem is free for the syndrome exchange
}

// out[o] ^= baked_coef(2*GI + o, TI) * z: baked_mac for 2 outputs.
template <int GI, int TI>
__device__ __forceinline__ void baked_mac2(uint32_t (&out)[2][16], uint32_t (&z)[16]) {
  constexpr uint32_t c0 = leto_gf::baked_coef(2 * GI, TI), c1 = leto_gf::baked_coef(2 * GI + 1, TI);
  if constexpr ((c0 | c1) != 0) {
#pragma unroll
    for (int b = 0; b < 16; ++b) {
      if ((c0 >> b) & 1u) {
#pragma unroll
        for (int r = 0; r < 16; ++r) out[0][r] ^= z[r];
      }
      if ((c1 >> b) & 1u) {
#pragma unroll
        for (int r = 0; r < 16; ++r) out[1][r] ^= z[r];
      }
      if (b < 15) leto_gf::mul_x(z);
    }
  }
}

// As run_group_with for the baked encode (m_out 16, no bases, no scale): page loop, exchange of
// the syndromes through shared memory, then outputs 2*GI and 2*GI+1.
template <class C, int GI>
__device__ __forceinline__ void run_group_g8(const SyndromeArgs& a, uint8_t* smem) {
  constexpr int NB = C::NB;
  uint32_t acc[2][16];
  static_for<2>([&](auto k) { static_for<16>([&](auto r) { acc[LETO_CV(k)][LETO_CV(r)] = 0u; }); });

  page_loop_g8<C, GI>(a, smem, acc);

  const int col = g8_col_fresh();

  uint32_t* syn = reinterpret_cast<uint32_t*>(smem);
  static_for<2>([&](auto k) {
    constexpr int ti = g8_t(GI, LETO_CV(k)) - leto_gf::kTLo;
    static_for<16>([&](auto r) { syn[(ti * 16 + LETO_CV(r)) * C::kCols + col] = acc[LETO_CV(k)][LETO_CV(r)]; });
  });
  __syncthreads();

  uint32_t out[2][16];
  static_for<2>([&](auto o) { static_for<16>([&](auto r) { out[LETO_CV(o)][LETO_CV(r)] = 0u; }); });
  // Run-time ti, compile-time specialisations (as run_group_with: no hoisting of 256 loads).
#pragma unroll 1
  for (int ti = 0; ti < 16; ++ti) {
    uint32_t z[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) z[r] = syn[(ti * 16 + r) * C::kCols + col];
    static_for<16>([&](auto tc) {
      if (ti == LETO_CV(tc)) baked_mac2<GI, LETO_CV(tc)>(out, z);
    });
  }
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int ocol = g8_col_fresh();  // (again: not live across the mix)
  const int obl = ocol / 16, oq = ocol % 16;
  if (tile_index<C>() * NB + obl >= blocks) return;  // after the last barrier
  const size_t off = static_cast<size_t>(tile_index<C>()) * NB * 1024 + static_cast<size_t>(obl) * 1024 + oq * 4;
  static_for<2>([&](auto o) {
    uint8_t* dst = a.outs[2 * GI + LETO_CV(o)] + off;
    static_for<16>([&](auto r) { *reinterpret_cast<uint32_t*>(dst + LETO_CV(r) * 64) = out[LETO_CV(o)][LETO_CV(r)]; });
  });
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks) syndrome_mix_g8_kernel(const SyndromeArgs a) {
  extern __shared__ __align__(16) uint8_t smem[];
  switch (g8_group()) {  // warp-uniform
    case 0: run_group_g8<C, 0>(a, smem); break;
    case 1: run_group_g8<C, 1>(a, smem); break;
    case 2: run_group_g8<C, 2>(a, smem); break;
    case 3: run_group_g8<C, 3>(a, smem); break;
    case 4: run_group_g8<C, 4>(a, smem); break;
    case 5: run_group_g8<C, 5>(a, smem); break;
    case 6: run_group_g8<C, 6>(a, smem); break;
    default: run_group_g8<C, 7>(a, smem); break;
  }
}

template <class C>
void launch_g8(const SyndromeArgs& a, const MixMasks&, cudaStream_t stream) {
  if (a.m_out != leto_gf::kBakedM || a.bases != nullptr || a.scaled || a.batch > 1 ||
      a.page_bytes >= (int64_t(1) << 32))
    throw std::runtime_error("g8 variants: baked encode only (m_out 16, no bases, scale or batch, < 4 GiB pages)");
  auto kern = syndrome_mix_g8_kernel<C>;
  static bool once = [&] {
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem), "attr");
    // All shared memory, so that kMinBlocks CTAs fit whatever the driver would pick for L1.
    check(cudaFuncSetAttribute(kern, cudaFuncAttributePreferredSharedMemoryCarveout, 100), "carveout");
    cudaFuncAttributes fa{};
    int per_sm = 0;
    check(cudaFuncGetAttributes(&fa, kern), "func attributes");
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, C::kThreads, C::kSmem), "occupancy");
    std::printf("  [g8 nb%d kp%d ns%d: %d regs, %zu B local, %d B smem, %d CTAs/SM (%d warps), asked %d]\n",
                C::NB, C::kP, C::kNS, fa.numRegs, fa.localSizeBytes, C::kSmem, per_sm,
                per_sm * C::kThreads / 32, C::kMinBlocks);
    return true;
  }();
  (void)once;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  kern<<<dim3((blocks + C::NB - 1) / C::NB, 1), C::kThreads, C::kSmem, stream>>>(a);
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
      // 8 groups of 2 syndromes; the last number: CTAs per SM asked (registers, see CfgG8).
      {"g8 nb2 kp4 ns4 b3", launch_g8<CfgG8<2, 4, 4, 3>>},
      {"g8 nb2 kp4 ns4 b4", launch_g8<CfgG8<2, 4, 4, 4>>},
      {"g8 nb4 kp4 ns4 b2", launch_g8<CfgG8<4, 4, 4, 2>>},
      {"g8 nb2 kp8 ns3 b3", launch_g8<CfgG8<2, 8, 3, 3>>},
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
