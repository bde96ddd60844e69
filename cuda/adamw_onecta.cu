// RMU's chunk in one kernel with one CTA per tile for all three states (benchmarks only, in the
// `leto_rmu_fold` extension): the CTA loads old p, m, v and g of its tile once (16 bytes per
// parameter, against 32 over the three CTAs of adamw_syndrome.cu), three thread sets of 128
// (one per state, 2 KiB tiles) each compute their state's new value, store it and run their
// state's Horner; fold: the old values are read in place and written to the undo buffer by the
// same kernel (no cluster needed: only this CTA reads or writes its tile of the three states).
// 384 threads at 128 registers: one CTA (12 warps) per SM.
//
// References: adamw_syndrome.cu (same states and parity bits; with fold, on an undo copy made
// beforehand, whose bytes the undo buffer then holds).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_fused_loop.cuh"
#include "adamw_syndrome.h"

namespace {

using CfgOne = Cfg<2, 2, 3, true, true, true, false>;       // baked mix
using CfgOneRt = Cfg<2, 2, 3, true, true, false, false>;    // run-time mix
constexpr int kSets = 3;                                     // thread sets: params, exp_avg, exp_avg_sq
constexpr int kOneSlots = 7;                                 // p, m, v, g, then the 3 deltas

template <class C>
struct OneSmem {
  static constexpr int kSlot = C::kP * C::kPageSmem;
  static constexpr int kStage = kOneSlots * kSlot;
  static constexpr int kPipe = C::kNS * kStage;
  static constexpr int kBytes = kPipe > kSets * C::kSynBytes ? kPipe : kSets * C::kSynBytes;
};

template <class C, int GI, int V, bool kFold>
__device__ __forceinline__ void onecta_loop(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, int y,
                                            int lt, uint8_t* smem, uint32_t (&acc)[4][16]) {
  using S = OneSmem<C>;
  constexpr int NB = C::NB;
  const int col = lt % 32;
  const int bl = col / 16, q = col % 16;
  const size_t tile_off = static_cast<size_t>(blockIdx.x) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / C::kP;
  const int cbl = lt / 64, cch = lt % 64;          // this thread's 16 bytes of each page
  const bool cvalid = static_cast<int>(blockIdx.x) * NB + cbl < blocks;
  const size_t csrc = tile_off + static_cast<size_t>(cbl) * 1024 + cch * 16;
  const int cdst = cbl * C::kBlockStride + cch * 16;
  uint8_t* out = reinterpret_cast<uint8_t*>(y == 0 ? f.state[0] : (y == 1 ? f.state[1] : f.state[2]));
  uint8_t* undo = reinterpret_cast<uint8_t*>(y == 0 ? f.undo[0] : (y == 1 ? f.undo[1] : f.undo[2]));
  // The sets' copy duty: params loads p and g, the moments their own state.
  const uint8_t* src0 = kFold ? reinterpret_cast<const uint8_t*>(out)
                              : reinterpret_cast<const uint8_t*>(y == 0 ? f.old[0] : (y == 1 ? f.old[1] : f.old[2]));
  const uint8_t* gsrc = reinterpret_cast<const uint8_t*>(f.g);
  const float coef = f.s.has_coef ? *f.coef : 1.0f;
  auto page_of = [&](int s, int p) { return n_pad - 1 - (s * C::kP + p); };
  auto valid = [&](int j) { return j < a.n && cvalid; };
  auto slot = [&](uint8_t* st, int i, int p) { return reinterpret_cast<float4*>(st + i * S::kSlot + p * C::kPageSmem); };
  auto issue = [&](int s) {
    if (s < n_stages) {
      uint8_t* st = smem + (s % C::kNS) * S::kStage + cdst;
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = page_of(s, p);
        if (valid(j)) {
          const size_t off = static_cast<size_t>(j) * a.page_bytes + csrc;
          cp_async16(slot(st, y, p), src0 + off);
          if (y == 0) cp_async16(slot(st, 3, p), gsrc + off);
        }
      }
    }
    cp_async_commit();
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
      uint4* dslot = reinterpret_cast<uint4*>(slot(st, 4 + y, p));
      if (valid(j)) {
        const float4 o = *slot(st, y, p);
        const float4 g = *slot(st, 3, p);
        const float4 n = y == 0 ? new_param<V>(o, *slot(st, 1, p), *slot(st, 2, p), g, coef, f.s)
                                : new_moment<V>(y, o, g, coef, f.s);
        const size_t off = static_cast<size_t>(j) * a.page_bytes + csrc;
        if (kFold) *reinterpret_cast<float4*>(undo + off) = o;
        *reinterpret_cast<float4*>(out + off) = n;
        *dslot = xor_bits(o, n);
      } else {
        *dslot = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    __syncthreads();                       // every set's deltas are in
    issue(s + C::kNS - 1);
    const uint8_t* d0 = smem + (s % C::kNS) * S::kStage + (4 + y) * S::kSlot + bl * C::kBlockStride + q * 4;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      uint32_t d[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) d[r] = *reinterpret_cast<const uint32_t*>(d0 + p * C::kPageSmem + r * 64);
      group_step<GI>(acc, d);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
}

template <class C, int V, bool kFold>
__global__ void __launch_bounds__(kSets * C::kThreads, 1)
    adamw_onecta_kernel(const SyndromeArgs a_in, const leto_rmu::AdamWSyndromeArgs f,
                        const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  SyndromeArgs a = a_in;
  const int y = static_cast<int>(threadIdx.x) / C::kThreads;   // the thread's set = its state
  const int lt = static_cast<int>(threadIdx.x) % C::kThreads;
  a.outs += static_cast<int64_t>(y) * a.m_out;
  a.bases += static_cast<int64_t>(y) * a.m_out;
  uint8_t* syn = smem + y * C::kSynBytes;
  const int col = lt % 32;
  switch (thread_group()) {
    case 0: run_group_with<C, 0>(a, masks, syn, [&](uint32_t (&acc)[4][16]) { onecta_loop<C, 0, V, kFold>(a, f, y, lt, smem, acc); }, col); break;
    case 1: run_group_with<C, 1>(a, masks, syn, [&](uint32_t (&acc)[4][16]) { onecta_loop<C, 1, V, kFold>(a, f, y, lt, smem, acc); }, col); break;
    case 2: run_group_with<C, 2>(a, masks, syn, [&](uint32_t (&acc)[4][16]) { onecta_loop<C, 2, V, kFold>(a, f, y, lt, smem, acc); }, col); break;
    default: run_group_with<C, 3>(a, masks, syn, [&](uint32_t (&acc)[4][16]) { onecta_loop<C, 3, V, kFold>(a, f, y, lt, smem, acc); }, col); break;
  }
}

template <class C, bool kFold>
void launch_onecta(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
                   cudaStream_t stream) {
  launch_tiles<C, adamw_onecta_kernel<C, 0, kFold>>(kSets * C::kThreads, OneSmem<C>::kBytes, a, f, masks, stream,
                                                    "adamw_syndrome_onecta kernel launch");
}

}  // namespace

namespace leto_rmu {

void adamw_syndrome_onecta(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, bool fold,
                           cudaStream_t stream) {
  SyndromeArgs a;
  MixMasks masks{};
  const float* undo[3] = {fold ? f.undo[0] : f.old[0], fold ? f.undo[1] : f.old[1], fold ? f.undo[2] : f.old[2]};
  bool baked = false;
  if (!prepare_chunk(args, f, undo, coef, a, masks, baked)) return;
  switch ((baked ? 1 : 0) + (fold ? 2 : 0)) {
    case 0: launch_onecta<CfgOneRt, false>(a, f, masks, stream); break;
    case 1: launch_onecta<CfgOne, false>(a, f, masks, stream); break;
    case 2: launch_onecta<CfgOneRt, true>(a, f, masks, stream); break;
    default: launch_onecta<CfgOne, true>(a, f, masks, stream); break;
  }
}

}  // namespace leto_rmu
