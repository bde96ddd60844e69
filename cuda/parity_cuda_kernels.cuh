// Device code of the CUDA parity kernels, included by parity_cuda.cu (default variants) and
// parity_cuda_variants.cu (benchmark / cross-check variants): two translation units, so that
// the slow front-end compile of the unrolled kernels runs in parallel.  See parity_cuda.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "gf16_bitslice.h"
#include "parity_baked.h"
#include "parity_cuda.h"

namespace {

using leto_gf::static_for;

// The 16 exponents split over 4 thread groups, heavy (large |t|) with light, so that every
// group does about the same number of LOP3s per page (87, 85, 84, 83): all groups wait for the
// slowest one at each stage barrier.
__host__ __device__ constexpr int group_t(int g, int k) {
  constexpr int kT[4][4] = {{-7, -1, 0, 8}, {-6, -2, 1, 7}, {-5, -3, 2, 6}, {-4, 3, 4, 5}};
  return kT[g][k];
}

// One kernel variant.  NB: 1024-byte blocks per tile (16*NB columns, 64*NB threads); KP: pages
// per pipeline stage; NS: stages in the ring; ROLLED: loop over stages (small code, the plane
// rotation costs register moves once per stage) or unroll a whole rotation period of 16 pages
// (no moves, ~8x the code: instruction-cache misses); PIPE: cp.async through shared memory or
// plain global loads; BAKED: compiled-in mix matrix (the default code's encode); ZFILL: branch-free
// copies (a missing page is a zero-byte cp.async, which zero-fills) with the page addresses of
// the next stage loaded one stage ahead.
template <int NB_, int KP_, int NS_, bool ROLLED_, bool PIPE_, bool BAKED_, bool ZFILL_ = false>
struct Cfg {
  static constexpr int NB = NB_, kP = KP_, kNS = NS_;
  static constexpr bool kRolled = ROLLED_, kPipe = PIPE_, kBaked = BAKED_, kZfill = ZFILL_;
  // The tile a CTA owns is blockIdx.x; a kernel that orders its grid otherwise (the fused
  // AdamW + syndrome kernel's state-major grid: the three states of a tile in adjacent CTAs)
  // derives a Cfg with kTileY = true, and the tile is blockIdx.y.
  static constexpr bool kTileY = false;
  static_assert(!kZfill || (kRolled && kPipe), "ZFILL is a refinement of the rolled pipeline");
  static_assert(kRolled || kP * kNS == 16, "the unrolled loop covers one rotation period");
  static_assert(NB == 2 || NB == 4, "a warp must hold 32 columns of one group");
  static constexpr int kCols = 16 * NB;            // 32-bit columns per tile
  static constexpr int kThreads = 4 * kCols;       // 4 groups per column
  static constexpr int kMinBlocks = 8 / NB;        // 16 warps per SM at 128 registers
  static constexpr int kBlockStride = 1024 + 64;   // smem stride of a block: +16 banks per block
  static constexpr int kPageSmem = NB * kBlockStride;
  static constexpr int kStageBytes = kP * kPageSmem;
  static constexpr int kPipeBytes = kNS * kStageBytes;
  static constexpr int kSynBytes = 256 * kCols * 4;  // [t*16 + plane][column]
  static constexpr int kSmem = kPipeBytes > kSynBytes ? kPipeBytes : kSynBytes;
};

// Thread roles.  Warp w belongs to thread group w % 4 and covers columns 32*(w / 4) .. +31.
// Warps are dealt to the 4 SM sub-partitions round-robin (w % 4), so every sub-partition runs
// the code of one group only: the unrolled page loop of one group (~30 KB) instead of two.
__device__ __forceinline__ int thread_group() { return (threadIdx.x / 32) % 4; }
__device__ __forceinline__ int thread_col() { return (threadIdx.x / 128) * 32 + threadIdx.x % 32; }
template <class C>
__device__ __forceinline__ int tile_index() { return static_cast<int>(C::kTileY ? blockIdx.y : blockIdx.x); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
// Copies src_bytes (16 or 0) and zero-fills the rest of the 16 bytes: no branch for a missing page.
__device__ __forceinline__ void cp_async16_z(void* smem, const void* gmem, unsigned src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// One Horner step for the 4 exponents of group GI on the 16 plane words d.
template <int GI>
__device__ __forceinline__ void group_step(uint32_t (&acc)[4][16], const uint32_t (&d)[16]) {
  static_for<4>([&](auto k) {
    leto_gf::horner_step<group_t(GI, LETO_CV(k)), true>(acc[LETO_CV(k)], d);
  });
}

// Main loop of one thread group.  kPipe=false reads page words straight from global memory
// (simple variant, kept as a cross-check of the pipeline); kCompute=false only keeps the
// pipeline going (a group whose syndromes no output needs).
template <class C, int GI, bool kCompute>
__device__ __forceinline__ void page_loop(const SyndromeArgs& a, uint8_t* smem,
                                          uint32_t (&acc)[4][16]) {
  constexpr int NB = C::NB;
  constexpr bool kPipe = C::kPipe;
  const int tid = threadIdx.x;
  const int col = thread_col();
  const int bl = col / 16, q = col % 16;
  const size_t tile_off = static_cast<size_t>(tile_index<C>()) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / C::kP;
  // Copy duty: one 16-byte chunk of every page of a stage (64*NB threads, 64*NB chunks).
  const int cbl = tid / 64, cch = tid % 64;
  const bool cvalid = tile_index<C>() * NB + cbl < blocks;
  const size_t csrc = tile_off + static_cast<size_t>(cbl) * 1024 + cch * 16;
  const int cdst = cbl * C::kBlockStride + cch * 16;

  auto issue = [&](int s, int buf) {
    if (kPipe && s < n_stages) {
      uint8_t* st = smem + buf * C::kStageBytes + cdst;
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = n_pad - 1 - (s * C::kP + p);
        const uint8_t* src = (j < a.n && cvalid) ? a.pages[j] : nullptr;
        if (src != nullptr) cp_async16(st + p * C::kPageSmem, src + csrc);
        else *reinterpret_cast<uint4*>(st + p * C::kPageSmem) = make_uint4(0, 0, 0, 0);
      }
    }
    cp_async_commit();  // always, so that group counting stays uniform
  };

  const bool mine_valid = tile_index<C>() * NB + bl < blocks;
  const size_t gword = tile_off + static_cast<size_t>(bl) * 1024 + q * 4;

  if constexpr (C::kZfill) {
    // As the rolled loop below, with branch-free copies and page addresses fetched a stage early
    // (their load latency no longer stalls the copy issue right after the barrier).
    const uint8_t* nxt[C::kP];
    auto fetch = [&](int s) {
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = n_pad - 1 - (s * C::kP + p);
        nxt[p] = (s < n_stages && j < a.n && cvalid) ? a.pages[j] : nullptr;
      }
    };
    auto issue_z = [&](int s, int buf) {
      if (s < n_stages) {
        uint8_t* st = smem + buf * C::kStageBytes + cdst;
#pragma unroll
        for (int p = 0; p < C::kP; ++p) {
          const uint8_t* src = nxt[p];
          cp_async16_z(st + p * C::kPageSmem, src ? static_cast<const void*>(src + csrc) : a.pages, src ? 16u : 0u);
        }
      }
      cp_async_commit();
    };
#pragma unroll
    for (int s = 0; s < C::kNS - 1; ++s) {
      fetch(s);
      issue_z(s, s);
    }
    fetch(C::kNS - 1);
#pragma unroll 1
    for (int s = 0; s < n_stages; ++s) {
      cp_async_wait<C::kNS - 2>();
      __syncthreads();
      issue_z(s + C::kNS - 1, (s + C::kNS - 1) % C::kNS);
      fetch(s + C::kNS);
      if constexpr (kCompute) {
        const uint8_t* st = smem + (s % C::kNS) * C::kStageBytes + bl * C::kBlockStride + q * 4;
#pragma unroll
        for (int p = 0; p < C::kP; ++p) {
          uint32_t d[16];
#pragma unroll
          for (int r = 0; r < 16; ++r)
            d[r] = *reinterpret_cast<const uint32_t*>(st + p * C::kPageSmem + r * 64);
          group_step<GI>(acc, d);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    return;
  }
#pragma unroll
  for (int s = 0; s < C::kNS - 1; ++s) issue(s, s);
  if constexpr (C::kRolled) {
    // One stage per iteration: ~8x less code (instruction-cache friendly); the plane rotation
    // then costs register moves at the loop edge, which the compiler can put on the FMA pipe.
#pragma unroll 1
    for (int s = 0; s < n_stages; ++s) {
      cp_async_wait<C::kNS - 2>();
      __syncthreads();
      issue(s + C::kNS - 1, (s + C::kNS - 1) % C::kNS);
      if constexpr (kCompute) {
        const uint8_t* st = smem + (s % C::kNS) * C::kStageBytes + bl * C::kBlockStride + q * 4;
#pragma unroll
        for (int p = 0; p < C::kP; ++p) {
          uint32_t d[16];
#pragma unroll
          for (int r = 0; r < 16; ++r)
            d[r] = *reinterpret_cast<const uint32_t*>(st + p * C::kPageSmem + r * 64);
          group_step<GI>(acc, d);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    return;
  }
  for (int s0 = 0; s0 < n_stages; s0 += C::kNS) {
#pragma unroll
    for (int u = 0; u < C::kNS; ++u) {  // u == (s0 + u) % kNS: compile-time buffer index
      const int s = s0 + u;
      cp_async_wait<C::kNS - 2>();
      __syncthreads();  // stage s visible to all; everyone is done with stage s-1's buffer
      issue(s + C::kNS - 1, (u + C::kNS - 1) % C::kNS);
      if constexpr (kCompute) {
        const uint8_t* st = smem + u * C::kStageBytes + bl * C::kBlockStride + q * 4;
#pragma unroll
        for (int p = 0; p < C::kP; ++p) {
          uint32_t d[16];
          if constexpr (kPipe) {
#pragma unroll
            for (int r = 0; r < 16; ++r)
              d[r] = *reinterpret_cast<const uint32_t*>(st + p * C::kPageSmem + r * 64);
          } else {
            const int j = n_pad - 1 - (s * C::kP + p);
            const uint8_t* pg = (j < a.n && mine_valid) ? a.pages[j] : nullptr;
#pragma unroll
            for (int r = 0; r < 16; ++r)
              d[r] = pg ? __ldg(reinterpret_cast<const uint32_t*>(pg + gword + r * 64)) : 0u;
          }
          group_step<GI>(acc, d);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // pipeline drained; smem is free for the syndrome exchange
}

// out[o] ^= baked_coef(4*GI + o, TI) * z.  The coefficients are compile-time constants once
// the loops are unrolled (baked_coef is a constexpr table), so only the XORs of set bits remain.
template <int GI, int TI>
__device__ __forceinline__ void baked_mac(uint32_t (&out)[4][16], uint32_t (&z)[16]) {
  constexpr int i0 = 4 * GI;
  if constexpr ((leto_gf::baked_coef(i0, TI) | leto_gf::baked_coef(i0 + 1, TI) |
                 leto_gf::baked_coef(i0 + 2, TI) | leto_gf::baked_coef(i0 + 3, TI)) != 0) {
#pragma unroll
    for (int b = 0; b < 16; ++b) {
#pragma unroll
      for (int o = 0; o < 4; ++o) {
        if ((leto_gf::baked_coef(i0 + o, TI) >> b) & 1u) {
#pragma unroll
          for (int r = 0; r < 16; ++r) out[o][r] ^= z[r];
        }
      }
      if (b < 15) leto_gf::mul_x(z);
    }
  }
}

// One thread group's whole job: `loop(acc)` runs the Horner page loop into the 4 syndromes of
// this group (page_loop for syndrome_mix; adamw_syndrome.cu computes its pages on the fly), then
// the scale, the exchange of syndromes through shared memory and the mix into the outputs.
// `col`: the thread's column (a kernel that runs several thread sets of kThreads per CTA, each
// with its own `smem` exchange area, passes its set's own).
template <class C, int GI, class Loop>
__device__ __forceinline__ void run_group_with(const SyndromeArgs& a, const MixMasks& masks,
                                               uint8_t* smem, Loop&& loop, int col = thread_col()) {
  constexpr int NB = C::NB;
  const int bl = col / 16, q = col % 16;
  uint32_t acc[4][16];
  static_for<4>([&](auto k) { static_for<16>([&](auto r) { acc[LETO_CV(k)][LETO_CV(r)] = 0u; }); });

  loop(acc);

  // Run-time scale of each syndrome (a run of pages that starts at position f: x^(f t)).
  if (a.scaled) {
    static_for<4>([&](auto k) {
      constexpr int ti = group_t(GI, LETO_CV(k)) - leto_gf::kTLo;
      const uint32_t c = a.scale[ti];
      uint32_t z[16], prod[1][16];
#pragma unroll
      for (int r = 0; r < 16; ++r) { z[r] = acc[LETO_CV(k)][r]; prod[0][r] = 0u; }
      leto_gf::mac_shift_xor<1>(prod, z, [&](int, int b) -> uint32_t { return 0u - ((c >> b) & 1u); });
#pragma unroll
      for (int r = 0; r < 16; ++r) acc[LETO_CV(k)][r] = prod[0][r];
    });
  }

  // Exchange: syn[(t*16 + r) * kCols + col]; consecutive columns -> consecutive banks.
  uint32_t* syn = reinterpret_cast<uint32_t*>(smem);
  static_for<4>([&](auto k) {
    constexpr int ti = group_t(GI, LETO_CV(k)) - leto_gf::kTLo;
    static_for<16>([&](auto r) { syn[(ti * 16 + LETO_CV(r)) * C::kCols + col] = acc[LETO_CV(k)][LETO_CV(r)]; });
  });
  __syncthreads();

  // Mix: this group computes outputs 4*GI .. 4*GI+3.
  const int i0 = 4 * GI;
  if (i0 >= a.m_out) return;
  uint32_t out[4][16];
  static_for<4>([&](auto o) { static_for<16>([&](auto r) { out[LETO_CV(o)][LETO_CV(r)] = 0u; }); });
  if constexpr (C::kBaked) {
    // ti is a run-time loop (so the scheduler cannot hoist all 256 syndrome loads and spill);
    // each iteration branches to a copy specialised for its compile-time ti.
#pragma unroll 1
    for (int ti = 0; ti < 16; ++ti) {
      uint32_t z[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) z[r] = syn[(ti * 16 + r) * C::kCols + col];
      static_for<16>([&](auto tc) {
        if (ti == LETO_CV(tc)) baked_mac<GI, LETO_CV(tc)>(out, z);
      });
    }
  } else {
#pragma unroll 1
    for (int ti = 0; ti < 16; ++ti) {
      if (!((a.col_mask >> ti) & 1u)) continue;
      uint32_t z[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) z[r] = syn[(ti * 16 + r) * C::kCols + col];
      leto_gf::mac_shift_xor<4>(out, z, [&](int o, int b) -> uint32_t { return masks.m[i0 + o][ti][b]; });
    }
  }
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  if (tile_index<C>() * NB + bl >= blocks) return;
  const size_t off = static_cast<size_t>(tile_index<C>()) * NB * 1024 + static_cast<size_t>(bl) * 1024 + q * 4;
  static_for<4>([&](auto o) {
    if (i0 + LETO_CV(o) < a.m_out) {
      uint8_t* dst = a.outs[i0 + LETO_CV(o)] + off;
      if (a.bases) {
        const uint8_t* src = a.bases[i0 + LETO_CV(o)] + off;
        static_for<16>([&](auto r) { out[LETO_CV(o)][LETO_CV(r)] ^= *reinterpret_cast<const uint32_t*>(src + LETO_CV(r) * 64); });
      }
      static_for<16>([&](auto r) { *reinterpret_cast<uint32_t*>(dst + LETO_CV(r) * 64) = out[LETO_CV(o)][LETO_CV(r)]; });
    }
  });
}

template <class C, int GI>
__device__ __forceinline__ void run_group(const SyndromeArgs& a, const MixMasks& masks,
                                          uint8_t* smem) {
  run_group_with<C, GI>(a, masks, smem, [&](uint32_t (&acc)[4][16]) {
    if ((a.group_mask >> GI) & 1u) page_loop<C, GI, true>(a, smem, acc);
    else page_loop<C, GI, false>(a, smem, acc);
  });
}

template <class C>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    syndrome_mix_kernel(const SyndromeArgs a_in, const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  SyndromeArgs a = a_in;             // problem blockIdx.y of the batch
  a.pages += static_cast<int64_t>(blockIdx.y) * a.n;
  a.outs += static_cast<int64_t>(blockIdx.y) * a.m_out;
  if (a.bases) a.bases += static_cast<int64_t>(blockIdx.y) * a.m_out;
  // The group index is warp-uniform, so each warp runs one compile-time specialisation: its
  // exponents are constants and the rotation can be renamed.
  switch (thread_group()) {
    case 0: run_group<C, 0>(a, masks, smem); break;
    case 1: run_group<C, 1>(a, masks, smem); break;
    case 2: run_group<C, 2>(a, masks, smem); break;
    default: run_group<C, 3>(a, masks, smem); break;
  }
}

template <int NB>
__global__ void __launch_bounds__(64 * NB)
    delta_kernel(const DeltaArgs a) {
  using C = Cfg<NB, 1, 1, true, true, false>;
  const int g = threadIdx.x / C::kCols;
  const int col = threadIdx.x % C::kCols;
  const int bl = col / 16, q = col % 16;
  const int i0 = blockIdx.y * 16 + 4 * g;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  if (i0 >= a.m_out || static_cast<int>(blockIdx.x) * NB + bl >= blocks) return;  // no barriers below
  const int no = a.m_out - i0 < 4 ? a.m_out - i0 : 4;
  const size_t off = static_cast<size_t>(blockIdx.x) * NB * 1024 + static_cast<size_t>(bl) * 1024 + q * 4;
  uint32_t acc[4][16];
  static_for<4>([&](auto o) {
    static_for<16>([&](auto r) {
      acc[LETO_CV(o)][LETO_CV(r)] =
          LETO_CV(o) < no ? *reinterpret_cast<const uint32_t*>(a.outs[i0 + LETO_CV(o)] + off + LETO_CV(r) * 64) : 0u;
    });
  });
  for (int l = 0; l < a.n; ++l) {
    uint32_t c[4];
#pragma unroll
    for (int o = 0; o < 4; ++o) c[o] = o < no ? static_cast<uint32_t>(a.coef[(i0 + o) * a.n + l]) : 0u;
    if ((c[0] | c[1] | c[2] | c[3]) == 0u) continue;
    const uint8_t* pa = a.a[l] + off;
    const uint8_t* pb = a.b[l];
    uint32_t z[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      z[r] = __ldg(reinterpret_cast<const uint32_t*>(pa + r * 64));
      if (pb != nullptr) z[r] ^= __ldg(reinterpret_cast<const uint32_t*>(pb + off + r * 64));
    }
    leto_gf::mac_shift_xor<4>(acc, z, [&](int o, int b) -> uint32_t { return 0u - ((c[o] >> b) & 1u); });
  }
  static_for<4>([&](auto o) {
    if (LETO_CV(o) < no) {
      uint8_t* dst = a.outs[i0 + LETO_CV(o)] + off;
      static_for<16>([&](auto r) { *reinterpret_cast<uint32_t*>(dst + LETO_CV(r) * 64) = acc[LETO_CV(o)][LETO_CV(r)]; });
    }
  });
}

// The launcher's share of a syndrome_mix: the coefficient bit masks, the t columns and thread
// groups in use.  Returns whether coef is the compiled-in matrix (baked kernels apply).
inline bool prepare_mix(SyndromeArgs& a, const uint16_t* coef, MixMasks& masks) {
  a.group_mask = 0;
  a.col_mask = 0;
  for (int i = 0; i < a.m_out; ++i)
    for (int t = 0; t < 16; ++t) {
      const uint32_t c = coef[i * 16 + t];
      if (c) a.col_mask |= 1u << t;
      for (int b = 0; b < 16; ++b) masks.m[i][t][b] = ((c >> b) & 1u) ? 0xFFFFFFFFu : 0u;
    }
  for (int g = 0; g < 4; ++g)
    for (int k = 0; k < 4; ++k)
      if ((a.col_mask >> (group_t(g, k) - leto_gf::kTLo)) & 1u) a.group_mask |= 1u << g;
  if (a.m_out != leto_gf::kBakedM) return false;
  for (int i = 0; i < 16; ++i)
    for (int t = 0; t < 16; ++t)
      if (coef[i * 16 + t] != leto_gf::baked_coef(i, t)) return false;
  return true;
}

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

template <class C>
inline void launch_sm(const SyndromeArgs& a, const MixMasks& masks, cudaStream_t stream) {
  auto kern = syndrome_mix_kernel<C>;
  static bool attr = [&] {  // > 48 KB of dynamic shared memory needs an explicit opt-in
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem),
          "cudaFuncSetAttribute");
    return true;
  }();
  (void)attr;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const dim3 grid((blocks + C::NB - 1) / C::NB, a.batch < 1 ? 1 : a.batch);
  kern<<<grid, C::kThreads, C::kSmem, stream>>>(a, masks);
  check(cudaGetLastError(), "syndrome_mix kernel launch");
}

// The variants (see Cfg).  The default is the fastest measured on the H200 (docs/BENCHMARKS.md).
template <bool B> using CfgAuto = Cfg<4, 4, 4, true, true, B, true>;
template <bool B> using CfgPlain = Cfg<4, 4, 4, true, true, B, false>;
template <bool B> using CfgUnrolled = Cfg<4, 2, 8, false, true, B>;
template <bool B> using CfgNB2 = Cfg<2, 4, 4, true, true, B, true>;
using CfgSimple = Cfg<4, 2, 8, false, false, false>;

}  // namespace
