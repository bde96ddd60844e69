// The page loop of the one-kernel RMU chunk (AdamW + parity syndrome of the state deltas), shared
// by adamw_syndrome.cu (the updater's: the undo copy made before the launch; the kernel reads
// it) and the benchmarks' adamw_fold.cu (the undo copy folded in: the kernel reads the states
// in place and writes the undo copy itself); adamw_onecta.cu uses its per-element helpers.
// Device code (and the launch checks, prepare_chunk); included into an anonymous namespace's
// translation unit after parity_cuda_kernels.cuh.
//
// The CTA of state y owns one tile column of the chunk's pages and runs syndrome_mix's Horner
// loop over them (parity_cuda_kernels.cuh, run_group_with), except that a stage's pages are not
// copied in but computed: the old values a thread needs stream into shared memory with
// cp.async; each thread then runs AdamW on its 16 bytes of every page of the stage
// (adamw_math.cuh: the same per-element ops as the fused AdamW kernel), stores the new value of
// state y and leaves old ^ new in shared memory for the Horner step.
//
// Reads of the old values (why the two kernels differ):
//  * copy kernel (kFold = false): from the undo copies.  State 0 (params) needs old p, m, v and
//    g; states 1 and 2 need their own old value and g and recompute the bits state 0's CTA
//    derives for them.  The states are only written, never read, so the three CTAs of a tile
//    cannot race.
//  * fold kernel (kFold = true): each CTA reads only its own state in place (and g for the
//    moments), so it reads every byte before it overwrites it.  The params CTA needs the new
//    moments: the three CTAs of a tile form a thread-block cluster, the moments' CTAs leave
//    their new values in shared memory and the params CTA reads them from there (distributed
//    shared memory) after a cluster barrier.  kProgress: f.progress[y][tile] counts the stages
//    whose undo copy is visible; a stage's new values are stored only after its count is (the
//    next stage), so after a kill at any point a recovery could restore the pages of the first
//    `progress` stages from the undo buffer and leave all others, which are untouched (no
//    recovery uses this kernel: docs/RMU.md, "The folded chunk").  Without it the
//    order of undo and in-place stores is not guaranteed (the kernel bench's lower bound).
#pragma once

#include <cooperative_groups.h>

#include <cstdint>
#include <stdexcept>

#include "adamw_math.cuh"
#include "adamw_syndrome.h"
#include "parity_cuda_kernels.cuh"

namespace {

constexpr int kInputs = 4;   // old p, old m, old v, g (state 0 of the copy kernel)

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
// Each is checked against the two-kernel path on the device before use (fused.py).  The fold
// kernel runs layout 0 (its clusters are the three states of a tile: grid (tiles, 3)).
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

__device__ __forceinline__ uint4 xor_bits(float4 o, float4 n) {
  return make_uint4(__float_as_uint(o.x) ^ __float_as_uint(n.x), __float_as_uint(o.y) ^ __float_as_uint(n.y),
                    __float_as_uint(o.z) ^ __float_as_uint(n.z), __float_as_uint(o.w) ^ __float_as_uint(n.w));
}

// The new value of a moment (y = 1: exp_avg, 2: exp_avg_sq) from its old value o and g.
template <int V>
__device__ __forceinline__ float4 new_moment(int y, float4 o, float4 g, float coef,
                                             const leto_rmu::AdamWScalars& s) {
  if (y == 1) {
    auto upd = [&](float mo, float gg) { return leto_rmu_math::exp_avg<V>(mo, leto_rmu_math::grad(gg, coef, s), s); };
    return make_float4(upd(o.x, g.x), upd(o.y, g.y), upd(o.z, g.z), upd(o.w, g.w));
  }
  auto upd = [&](float vo, float gg) { return leto_rmu_math::exp_avg_sq<V>(vo, leto_rmu_math::grad(gg, coef, s), s); };
  return make_float4(upd(o.x, g.x), upd(o.y, g.y), upd(o.z, g.z), upd(o.w, g.w));
}

// The new params from old p, the old moments and g (the copy kernel's state 0).
template <int V>
__device__ __forceinline__ float4 new_param(float4 po, float4 mo, float4 vo, float4 g, float coef,
                                            const leto_rmu::AdamWScalars& s) {
  auto upd = [&](float p, float m0, float v0, float gg) {
    const float gc = leto_rmu_math::grad(gg, coef, s);
    return leto_rmu_math::param<V>(p, leto_rmu_math::exp_avg<V>(m0, gc, s), leto_rmu_math::exp_avg_sq<V>(v0, gc, s), s);
  };
  return make_float4(upd(po.x, mo.x, vo.x, g.x), upd(po.y, mo.y, vo.y, g.y), upd(po.z, mo.z, vo.z, g.z),
                     upd(po.w, mo.w, vo.w, g.w));
}

// The new params from old p and the new moments (the fold kernel's state 0).
template <int V>
__device__ __forceinline__ float4 param_of(float4 po, float4 m, float4 v, const leto_rmu::AdamWScalars& s) {
  return make_float4(leto_rmu_math::param<V>(po.x, m.x, v.x, s), leto_rmu_math::param<V>(po.y, m.y, v.y, s),
                     leto_rmu_math::param<V>(po.z, m.z, v.z, s), leto_rmu_math::param<V>(po.w, m.w, v.w, s));
}

// The launch checks both kernels share, and the launch's arguments: a = args for the batch of 3
// states, masks = the mix (baked: compiled in).  `undo`: the undo copies (read by the copy
// kernel, written by the fold kernel).  False: an empty chunk (nothing to launch).
// Throws std::runtime_error on a bad argument.
inline bool prepare_chunk(const SyndromeArgs& args, const leto_rmu::AdamWSyndromeArgs& f, const float* const (&undo)[3],
                          const uint16_t* coef, SyndromeArgs& a, MixMasks& masks, bool& baked) {
  if (args.m_out < 1 || args.m_out > 16) throw std::runtime_error("adamw_syndrome: 1..16 parity outputs");
  if (args.page_bytes <= 0 || args.page_bytes % 1024) throw std::runtime_error("adamw_syndrome: page_bytes % 1024 != 0");
  if (args.bases == nullptr) throw std::runtime_error("adamw_syndrome: base parity pages are required");
  for (const void* p : {static_cast<const void*>(f.state[0]), static_cast<const void*>(f.state[1]),
                        static_cast<const void*>(f.state[2]), static_cast<const void*>(undo[0]),
                        static_cast<const void*>(undo[1]), static_cast<const void*>(undo[2]),
                        static_cast<const void*>(f.g)})
    if (p == nullptr || reinterpret_cast<uintptr_t>(p) % 16)
      throw std::runtime_error("adamw_syndrome: states, undo copies and gradients must be 16-byte aligned");
  if (args.n <= 0) return false;
  a = args;
  a.pages = nullptr;
  a.batch = 3;
  baked = prepare_mix(a, coef, masks);
  return true;
}

// The launch of a one-CTA-per-tile chunk kernel (adamw_onecta.cu, adamw_ws.cu): the opt-in to
// `smem` bytes of dynamic shared memory (once per kernel) and a grid of the chunk's tiles.
template <class C, auto kKernel>
inline void launch_tiles(int threads, int smem, const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f,
                         const MixMasks& masks, cudaStream_t stream, const char* what) {
  static bool attr = [&] {
    check(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
    return true;
  }();
  (void)attr;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  kKernel<<<dim3(static_cast<unsigned>((blocks + C::NB - 1) / C::NB)), threads, smem, stream>>>(a, f, masks);
  check(cudaGetLastError(), what);
}

template <class C, int GI, int V, bool kFold, bool kProgress>
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
  const int n_in = kFold ? (y == 0 ? 1 : 2) : (y == 0 ? 4 : 2);
  // (Selected with constant indices: a run-time index into the kernel parameters would copy
  // them to local memory.)
  uint8_t* out = reinterpret_cast<uint8_t*>(y == 0 ? f.state[0] : (y == 1 ? f.state[1] : f.state[2]));
  uint8_t* undo = reinterpret_cast<uint8_t*>(y == 0 ? f.undo[0] : (y == 1 ? f.undo[1] : f.undo[2]));
  const uint8_t* in[kInputs];
  if (kFold) {
    in[0] = out;
    in[1] = reinterpret_cast<const uint8_t*>(f.g);
  } else {
    in[0] = reinterpret_cast<const uint8_t*>(y == 0 ? f.old[0] : (y == 1 ? f.old[1] : f.old[2]));
    in[1] = reinterpret_cast<const uint8_t*>(y == 0 ? f.old[1] : f.g);
  }
  in[2] = reinterpret_cast<const uint8_t*>(f.old[2]);
  in[3] = reinterpret_cast<const uint8_t*>(f.g);
  const float coef = f.s.has_coef ? *f.coef : 1.0f;

  auto page_of = [&](int s, int p) { return n_pad - 1 - (s * C::kP + p); };
  auto valid = [&](int j) { return j < a.n && cvalid; };
  auto issue = [&](int s) {
    if (s < n_stages) {
      uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = page_of(s, p);
        if (valid(j)) {
          const size_t off = static_cast<size_t>(j) * a.page_bytes + csrc;
#pragma unroll
          for (int i = 0; i < kInputs; ++i)   // constant indices: `in` stays in registers
            if (i < n_in) cp_async16(st + i * S::kSlot + p * C::kPageSmem, in[i] + off);
        }
      }
    }
    cp_async_commit();   // always, so that group counting stays uniform
  };
  auto slot = [&](uint8_t* st, int i, int p) { return reinterpret_cast<float4*>(st + i * S::kSlot + p * C::kPageSmem); };

  // Fold with progress: stage s's new values wait in slot 1 until the next stage, when its undo
  // copy is known to be visible and counted in f.progress.
  auto store_new = [&](int s) {
    uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = page_of(s, p);
      if (valid(j)) *reinterpret_cast<float4*>(out + static_cast<size_t>(j) * a.page_bytes + csrc) = *slot(st, 1, p);
    }
  };
  uint32_t* progress = kProgress ? f.progress + static_cast<size_t>(y) * gridDim.x + tile_index<C>() : nullptr;

#pragma unroll
  for (int s = 0; s < C::kNS - 1; ++s) issue(s);
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    cp_async_wait<C::kNS - 2>();
    __syncthreads();                       // stage s's inputs are in; stage s-1's Horner is done
    uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
    if constexpr (kFold) {
#if __CUDA_ARCH__ >= 900
      // The moments' CTAs leave their new values where g was; the params CTA reads them after
      // the barrier.  (The buffer is refilled only after the next stage's cluster barrier.  A
      // split arrive/wait, the moments' CTAs waiting only before that refill, measured slower:
      // docs/BENCHMARKS.md.)
      if (y != 0) {
#pragma unroll
        for (int p = 0; p < C::kP; ++p)
          if (valid(page_of(s, p))) *slot(st, 1, p) = new_moment<V>(y, *slot(st, 0, p), *slot(st, 1, p), coef, f.s);
      }
      cooperative_groups::this_cluster().sync();
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = page_of(s, p);
        if (valid(j))
          *reinterpret_cast<float4*>(undo + static_cast<size_t>(j) * a.page_bytes + csrc) = *slot(st, 0, p);
      }
      if (kProgress && s > 0) store_new(s - 1);   // progress >= s is visible (the barrier above)
#endif
    }
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = page_of(s, p);
      uint4* slot0 = reinterpret_cast<uint4*>(slot(st, 0, p));
      if (valid(j)) {
        const float4 o = *slot(st, 0, p);
        float4 n;
        if constexpr (kFold) {
#if __CUDA_ARCH__ >= 900
          if (y == 0) {
            auto cl = cooperative_groups::this_cluster();
            n = param_of<V>(o, *cl.map_shared_rank(slot(st, 1, p), 1), *cl.map_shared_rank(slot(st, 1, p), 2), f.s);
          } else {
            n = *slot(st, 1, p);
          }
#else
          n = o;                           // never launched below sm_90 (adamw_fold.cu refuses)
#endif
        } else if (y == 0) {
          n = new_param<V>(o, *slot(st, 1, p), *slot(st, 2, p), *slot(st, 3, p), coef, f.s);
        } else {
          n = new_moment<V>(y, o, *slot(st, 1, p), coef, f.s);
        }
        if (kProgress) {
          if (y == 0) *slot(st, 1, p) = n;   // (the moments' new values are there already)
        } else {
          *reinterpret_cast<float4*>(out + static_cast<size_t>(j) * a.page_bytes + csrc) = n;
        }
        *slot0 = xor_bits(o, n);
      } else {
        *slot0 = make_uint4(0u, 0u, 0u, 0u);   // past the chunk (or the page): a zero delta
      }
    }
    if (kProgress) __threadfence();        // this stage's undo stores are visible ...
    __syncthreads();                       // the stage's deltas are visible to every group
    if (kProgress && tid == 0) {           // ... before it is counted, and the count before the
      *reinterpret_cast<volatile uint32_t*>(progress) = static_cast<uint32_t>(s + 1);
      __threadfence();                     // stage's new values (stored after the next barrier)
    }
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
  __syncthreads();                         // pipeline drained (and the last stage counted)
  if (kProgress) store_new(n_stages - 1);
#if __CUDA_ARCH__ >= 900
  // No peer reads this CTA's shared memory any more, and it is free for the exchange.
  if constexpr (kFold) cooperative_groups::this_cluster().sync();
#endif
}

}  // namespace
