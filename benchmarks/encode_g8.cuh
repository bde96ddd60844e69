// The 8-group encode variants of benchmarks/encode_kernels.cu (included there, inside its
// anonymous namespace, after the mbarrier helpers): 8 thread groups of 2 syndromes each, so a
// thread needs half the registers of the default kernel and an SM holds 24-32 warps.
#pragma once
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
