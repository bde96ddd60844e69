// RMU's chunk update in one pass: AdamW of the chunk and the parity delta of its three states,
// without the delta pages ever going through memory (docs/RMU.md, "The parity delta update";
// what the separate passes cost: docs/BENCHMARKS.md, "RMU steady-state overhead").
//
// References: the two-kernel path it replaces, bit for bit -- adamw_cuda.cu (new p, m, v and the
// delta pages old ^ new) followed by parity_cuda's syndrome_mix over those deltas with the run
// scale and base pages (Q' = Q ^ M diag(x^(f t)) S(delta)); and through them
// leto_runtime/rmu/adamw.py `adamw_chunk_` and leto_runtime/parity/reference.py.
//
// Grid: (tiles of NB KiB of a page, 3 states).  The CTA of state y owns one tile column of the
// chunk's pages and runs syndrome_mix's Horner loop over them (parity_cuda_kernels.cuh,
// run_group_with), except that a stage's pages are not copied in but computed: the old values a
// thread needs (from the undo copy, which the updater made before this launch: the in-place
// state is only written here, never read, so the three CTAs of a tile cannot race) stream into
// shared memory with cp.async; each thread then runs AdamW on its 16 bytes of every page of the
// stage (adamw_math.cuh: the same per-element ops as the fused AdamW kernel), stores the new
// value of state y in place and leaves old ^ new in shared memory for the Horner step.  State
// 0 (params) needs old p, m, v and g; states 1 and 2 (exp_avg, exp_avg_sq) need their own old
// value and g, and recompute the same bits that state 0's CTA derives for them.
//
// Memory per chunk element: reads of g and old values (8 floats over the 3 CTAs), writes of the
// 3 new values; the two-kernel path also writes and re-reads the 3 delta values.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_math.cuh"
#include "adamw_syndrome.h"
#include "parity_cuda_kernels.cuh"

namespace {

constexpr int kInputs = 4;   // old p, old m, old v, g (state 0); states 1, 2 use slots 0 and 1

// Cfgs of the fused loop (the `layout` argument; leto_runtime/rmu/fused.py LAYOUTS):
//  0: 4 KiB tiles (NB = 4, 256 threads), 2 pages per stage, 3 stages; grid (tiles, 3 states).
//     102 KiB of shared memory: two CTAs per SM, as the 128 registers allow.
//  1: the same, state-major grid (3 states, tiles): the three CTAs of a tile are adjacent in
//     launch order, so they run together and g, old m and old v -- which two or three of them
//     read -- come from L2 instead of HBM for all but the first (44 -> ~28 bytes of HBM
//     traffic per parameter if they stay in step).
//  2: 2 KiB tiles (NB = 2, 128 threads), 2 pages per stage, 3 stages: 51 KiB, four CTAs per SM
//     at the same 16 warps, so one CTA's barrier-bound AdamW phase overlaps another's Horner.
//  3: 2 with the state-major grid.
// Each is checked against the two-kernel path on the device before use (fused.py).
template <bool B>
using CfgFused = Cfg<4, 2, 3, true, true, B, false>;
template <bool B>
using CfgFusedNarrow = Cfg<2, 2, 3, true, true, B, false>;
template <class C>
struct StateMajor : C {
  static constexpr bool kTileY = true;
};

template <class C>
struct FusedSmem {
  static constexpr int kSlot = C::kP * C::kPageSmem;            // one input array of one stage
  static constexpr int kStage = kInputs * kSlot;
  static constexpr int kPipe = C::kNS * kStage;
  static constexpr int kBytes = kPipe > C::kSynBytes ? kPipe : C::kSynBytes;
};

template <class C, int GI, int V>
__device__ __forceinline__ void fused_loop(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f,
                                           int y, uint8_t* smem, uint32_t (&acc)[4][16]) {
  using S = FusedSmem<C>;
  constexpr int NB = C::NB;
  const int tid = threadIdx.x;
  const int col = thread_col();
  const int bl = col / 16, q = col % 16;
  const size_t tile_off = static_cast<size_t>(tile_index<C>()) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / C::kP;
  // This thread's 16 bytes of every page (as syndrome_mix's copy duty).
  const int cbl = tid / 64, cch = tid % 64;
  const bool cvalid = tile_index<C>() * NB + cbl < blocks;
  const size_t csrc = tile_off + static_cast<size_t>(cbl) * 1024 + cch * 16;
  const int cdst = cbl * C::kBlockStride + cch * 16;
  const int n_in = y == 0 ? 4 : 2;
  // (Selected with constant indices: a run-time index into the kernel parameters would copy
  // them to local memory.)
  const uint8_t* in[kInputs];
  in[0] = reinterpret_cast<const uint8_t*>(y == 0 ? f.old[0] : (y == 1 ? f.old[1] : f.old[2]));
  in[1] = reinterpret_cast<const uint8_t*>(y == 0 ? f.old[1] : f.g);
  in[2] = reinterpret_cast<const uint8_t*>(f.old[2]);
  in[3] = reinterpret_cast<const uint8_t*>(f.g);
  uint8_t* out = reinterpret_cast<uint8_t*>(y == 0 ? f.state[0] : (y == 1 ? f.state[1] : f.state[2]));
  const float coef = f.s.has_coef ? *f.coef : 1.0f;

  auto page_of = [&](int s, int p) { return n_pad - 1 - (s * C::kP + p); };
  auto issue = [&](int s) {
    if (s < n_stages) {
      uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = page_of(s, p);
        if (j < a.n && cvalid) {
          const size_t off = static_cast<size_t>(j) * a.page_bytes + csrc;
#pragma unroll
          for (int i = 0; i < kInputs; ++i)   // constant indices: `in` stays in registers
            if (i < n_in) cp_async16(st + i * S::kSlot + p * C::kPageSmem, in[i] + off);
        }
      }
    }
    cp_async_commit();   // always, so that group counting stays uniform
  };

#pragma unroll
  for (int s = 0; s < C::kNS - 1; ++s) issue(s);
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<C::kNS - 2>();
    __syncthreads();                       // stage s's inputs are in; stage s-1's Horner is done
    uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = page_of(s, p);
      uint4* slot0 = reinterpret_cast<uint4*>(st + p * C::kPageSmem);
      if (j < a.n && cvalid) {
        float4 o = *reinterpret_cast<const float4*>(st + p * C::kPageSmem);
        const float4 x1 = *reinterpret_cast<const float4*>(st + S::kSlot + p * C::kPageSmem);
        float4 n;
        if (y == 0) {
          const float4 x2 = *reinterpret_cast<const float4*>(st + 2 * S::kSlot + p * C::kPageSmem);
          const float4 g = *reinterpret_cast<const float4*>(st + 3 * S::kSlot + p * C::kPageSmem);
          auto upd = [&](float po, float mo, float vo, float gg) {
            const float gc = leto_rmu_math::grad(gg, coef, f.s);
            const float m = leto_rmu_math::exp_avg<V>(mo, gc, f.s);
            const float v = leto_rmu_math::exp_avg_sq<V>(vo, gc, f.s);
            return leto_rmu_math::param<V>(po, m, v, f.s);
          };
          n = make_float4(upd(o.x, x1.x, x2.x, g.x), upd(o.y, x1.y, x2.y, g.y), upd(o.z, x1.z, x2.z, g.z),
                          upd(o.w, x1.w, x2.w, g.w));
        } else if (y == 1) {
          auto upd = [&](float mo, float gg) {
            return leto_rmu_math::exp_avg<V>(mo, leto_rmu_math::grad(gg, coef, f.s), f.s);
          };
          n = make_float4(upd(o.x, x1.x), upd(o.y, x1.y), upd(o.z, x1.z), upd(o.w, x1.w));
        } else {
          auto upd = [&](float vo, float gg) {
            return leto_rmu_math::exp_avg_sq<V>(vo, leto_rmu_math::grad(gg, coef, f.s), f.s);
          };
          n = make_float4(upd(o.x, x1.x), upd(o.y, x1.y), upd(o.z, x1.z), upd(o.w, x1.w));
        }
        *reinterpret_cast<float4*>(out + static_cast<size_t>(j) * a.page_bytes + csrc) = n;
        *slot0 = make_uint4(__float_as_uint(o.x) ^ __float_as_uint(n.x), __float_as_uint(o.y) ^ __float_as_uint(n.y),
                            __float_as_uint(o.z) ^ __float_as_uint(n.z), __float_as_uint(o.w) ^ __float_as_uint(n.w));
      } else {
        *slot0 = make_uint4(0u, 0u, 0u, 0u);   // past the chunk (or the page): a zero delta
      }
    }
    __syncthreads();                       // the stage's deltas are visible to every group
    issue(s + C::kNS - 1);                 // into stage s-1's buffer, free since the first barrier
    const uint8_t* d0 = smem + (s % C::kNS) * S::kStage + bl * C::kBlockStride + q * 4;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      uint32_t d[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) d[r] = *reinterpret_cast<const uint32_t*>(d0 + p * C::kPageSmem + r * 64);
      group_step<GI>(acc, d);
    }
  }
  cp_async_wait<0>();
  __syncthreads();                         // pipeline drained; smem is free for the exchange
}

template <class C, int V>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    adamw_syndrome_kernel(const SyndromeArgs a_in, const leto_rmu::AdamWSyndromeArgs f,
                          const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  SyndromeArgs a = a_in;
  const int y = static_cast<int>(C::kTileY ? blockIdx.x : blockIdx.y);
  a.outs += static_cast<int64_t>(y) * a.m_out;
  a.bases += static_cast<int64_t>(y) * a.m_out;
  switch (thread_group()) {
    case 0: run_group_with<C, 0>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 0, V>(a, f, y, smem, acc); }); break;
    case 1: run_group_with<C, 1>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 1, V>(a, f, y, smem, acc); }); break;
    case 2: run_group_with<C, 2>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 2, V>(a, f, y, smem, acc); }); break;
    default: run_group_with<C, 3>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 3, V>(a, f, y, smem, acc); }); break;
  }
}

template <class C>
void launch_fused(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
                  cudaStream_t stream) {
  auto kern = adamw_syndrome_kernel<C, 0>;
  constexpr int smem = FusedSmem<C>::kBytes;
  static bool attr = [&] {  // > 48 KB of dynamic shared memory needs an explicit opt-in
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
    return true;
  }();
  (void)attr;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const unsigned tiles = static_cast<unsigned>((blocks + C::NB - 1) / C::NB);
  if (C::kTileY && tiles > 65535u) throw std::runtime_error("adamw_syndrome: a state-major grid holds 65535 tiles");
  const dim3 grid = C::kTileY ? dim3(3, tiles) : dim3(tiles, 3);
  kern<<<grid, C::kThreads, smem, stream>>>(a, f, masks);
  check(cudaGetLastError(), "adamw_syndrome kernel launch");
}

}  // namespace

namespace leto_rmu {

void adamw_syndrome(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int variant,
                    int layout, cudaStream_t stream) {
  if (variant != 0) throw std::runtime_error("adamw_syndrome: only AdamW spelling (variant) 0 is compiled");
  if (layout < 0 || layout > 3) throw std::runtime_error("adamw_syndrome: layout must be 0..3");
  if (args.m_out < 1 || args.m_out > 16) throw std::runtime_error("adamw_syndrome: 1..16 parity outputs");
  if (args.page_bytes <= 0 || args.page_bytes % 1024) throw std::runtime_error("adamw_syndrome: page_bytes % 1024 != 0");
  if (args.bases == nullptr) throw std::runtime_error("adamw_syndrome: base parity pages are required");
  for (const void* p : {static_cast<const void*>(f.state[0]), static_cast<const void*>(f.state[1]),
                        static_cast<const void*>(f.state[2]), static_cast<const void*>(f.old[0]),
                        static_cast<const void*>(f.old[1]), static_cast<const void*>(f.old[2]),
                        static_cast<const void*>(f.g)})
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % 16)
      throw std::runtime_error("adamw_syndrome: states, undo copies and gradients must be 16-byte aligned");
  if (args.n <= 0) return;
  SyndromeArgs a = args;
  a.pages = nullptr;
  a.batch = 3;
  MixMasks masks{};
  const bool baked = prepare_mix(a, coef, masks);
  switch (layout * 2 + (baked ? 1 : 0)) {
    case 0: launch_fused<CfgFused<false>>(a, f, masks, stream); break;
    case 1: launch_fused<CfgFused<true>>(a, f, masks, stream); break;
    case 2: launch_fused<StateMajor<CfgFused<false>>>(a, f, masks, stream); break;
    case 3: launch_fused<StateMajor<CfgFused<true>>>(a, f, masks, stream); break;
    case 4: launch_fused<CfgFusedNarrow<false>>(a, f, masks, stream); break;
    case 5: launch_fused<CfgFusedNarrow<true>>(a, f, masks, stream); break;
    case 6: launch_fused<StateMajor<CfgFusedNarrow<false>>>(a, f, masks, stream); break;
    default: launch_fused<StateMajor<CfgFusedNarrow<true>>>(a, f, masks, stream); break;
  }
}

}  // namespace leto_rmu
