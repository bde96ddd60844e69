// Launch interface of the CUDA parity kernels (parity_cuda.cu), used by parity_cuda_binding.cpp.
// Plain CUDA runtime types only, so the kernels compile without torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

struct SyndromeArgs {
  const uint8_t* const* pages;  // device array of n page addresses (0 = all-zero page)
  int n;
  uint8_t* const* outs;         // device array of m_out output page addresses
  int m_out;                    // 1..16
  int64_t page_bytes;           // multiple of 1024
  uint32_t group_mask;          // set by the launcher: thread groups whose exponents are used
  uint32_t col_mask;            // set by the launcher: t columns with a non-zero coefficient
  // Batch: blockIdx.y picks problem y of `batch`; pages, outs (and bases) then hold batch
  // consecutive arrays of n, m_out (m_out) addresses, all mixed with the same coefficients.
  int batch;
  // Optional: outs = bases ^ mix (bases read, outs written; may be the same pages).
  const uint8_t* const* bases;
  // Optional (scaled != 0): S_t *= scale[t] before the mix (t = -7..8 -> index 0..15).  A run of
  // pages starting at position f has S_t(run at f) = x^(f t) S_t(run at 0): the delta of a chunk
  // then takes the code's own (baked) encode matrix instead of a per-chunk shifted one.
  int scaled;
  uint32_t scale[16];
};

// masks.m[i][t][b] = all-ones if bit b of coef[i][t] is set (coef columns t = -7..8).
struct MixMasks {
  uint32_t m[16][16][16];
};

struct DeltaArgs {
  uint8_t* const* outs;         // device array of m_out parity page addresses (updated in place)
  int m_out;
  const uint8_t* const* a;      // device arrays of n page addresses; b[l] may be 0 (a[l] is the delta)
  const uint8_t* const* b;
  int n;
  const int32_t* coef;          // device array, coef[i * n + l]
  int64_t page_bytes;
};

namespace leto_cuda {

// auto: the default (CfgAuto); nobake: the default with run-time mix coefficients even when
// baked ones exist; the others are benchmark / cross-check variants (parity_cuda_kernels.cuh).
enum Variant {
  kVariantAuto = 0, kVariantSimple = 1, kVariantNB2 = 2, kVariantNoBake = 3, kVariantPlain = 4,
  kVariantUnrolled = 5
};

// out_i = [base_i ^] sum_t coef[i*16 + t] * [scale_t *] sum_j x^(j (t-7)) page_j  (coef on the
// host), for each of args.batch problems.  Throws on error.
void syndrome_mix(const SyndromeArgs& args, const uint16_t* coef, int variant, cudaStream_t stream);
// out_i ^= sum_l coef[i][l] * (a_l ^ b_l).  Throws on error.
void delta_update(const DeltaArgs& args, cudaStream_t stream);
bool coef_is_baked(const uint16_t* coef, int m_out);
// Internal (parity_cuda_variants.cu): the kVariantSimple / kVariantNB2 launches.
void launch_variant(int variant, bool baked, const SyndromeArgs& a, const MixMasks& masks,
                    cudaStream_t stream);

}  // namespace leto_cuda
