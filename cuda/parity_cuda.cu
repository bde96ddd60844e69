// CUDA parity kernels: syndrome_mix (encode / decode / scrub) and delta_update.
//
// Reference: leto_runtime/parity/reference.py (syndrome_mix, delta_update); the bitsliced math is
// cuda/gf16_bitslice.h, shared with (and tested through) the CPU kernels.  No torch headers here:
// parity_cuda_binding.cpp is the torch face; this file only needs the CUDA runtime.
//
// syndrome_mix: out_i = sum_t coef[i][t] * S_t,  S_t = sum_j x^(j t) page_j,  t = -7..8.
//   A CTA owns a tile of NB 1024-byte blocks (16*NB columns of 32 symbols) of every page and
//   walks all pages once, top page first (Horner).  4 thread groups share each column, each
//   keeping 4 of the 16 syndromes in registers (64 words); warp w is group w % 4, so each SM
//   sub-partition runs one group's code.  Pages stream through shared memory with cp.async
//   (a ring of 4 stages of 4 pages) from an array of page addresses, so pages need not be
//   contiguous; a zero address (or a position past n) reads as an all-zero page (zero-byte
//   copy).  The page loop is "rolled" (one stage per iteration): unrolling a whole rotation
//   period of 16 pages makes the plane rotation free register renaming but costs ~8x the code,
//   and instruction-cache misses then cost more than the moves saved (docs/BENCHMARKS.md).
//   At the end the 16 syndromes of a column are exchanged through shared memory and each group
//   computes 4 outputs with the shift-xor multiply (mac_shift_xor).  The default code's encode
//   matrix is compiled in (parity_baked.h) - zero bits cost nothing - otherwise the coefficient
//   bit masks come from a 16 KB __grid_constant__ parameter.
// delta_update: out_i ^= sum_l coef[i][l] * (a_l ^ b_l); one thread per (column, 4 outputs),
//   page words loaded straight from global memory (the 4 groups share them through L1).
//
// Every launch goes to the caller's stream; nothing synchronizes.
#include "parity_cuda_kernels.cuh"

namespace leto_cuda {

bool coef_is_baked(const uint16_t* coef, int m_out) {
  SyndromeArgs a{};
  a.m_out = m_out;
  MixMasks masks{};
  return prepare_mix(a, coef, masks);
}

void syndrome_mix(const SyndromeArgs& args_in, const uint16_t* coef, int variant, cudaStream_t stream) {
  if (args_in.m_out < 1 || args_in.m_out > 16) throw std::runtime_error("syndrome_mix: 1..16 outputs");
  SyndromeArgs a = args_in;
  MixMasks masks{};
  const bool baked = prepare_mix(a, coef, masks);
  switch (variant) {
    case kVariantAuto: return baked ? launch_sm<CfgAuto<true>>(a, masks, stream) : launch_sm<CfgAuto<false>>(a, masks, stream);
    case kVariantNoBake: return launch_sm<CfgAuto<false>>(a, masks, stream);
    default: return launch_variant(variant, baked, a, masks, stream);
  }
}

void delta_update(const DeltaArgs& a, cudaStream_t stream) {
  constexpr int NB = 4;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const dim3 grid((blocks + NB - 1) / NB, (a.m_out + 15) / 16);
  delta_kernel<NB><<<grid, 64 * NB, 0, stream>>>(a);
  check(cudaGetLastError(), "delta_update kernel launch");
}

}  // namespace leto_cuda
