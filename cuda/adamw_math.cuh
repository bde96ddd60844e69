// Per-element AdamW of RMU, as the ATen CUDA kernels torch runs compute it (shared by the fused
// AdamW kernel, adamw_cuda.cu, and the AdamW + parity-syndrome kernel, adamw_syndrome.cu, so the
// two give the same bits by construction).  Reference: leto_runtime/rmu/adamw.py `adamw_chunk_`.
//
// Every operation is an explicit round-to-nearest intrinsic: nvcc may not contract a multiply of
// one torch op into the add of the next (that would be a different rounding from the separate
// kernels torch runs).  Within one op, the FMA that nvcc forms in ATen's own kernel
// (`a + alpha * x` compiles to fma(alpha, x, a) under the default -fmad=true) is written out.
// Variant V: bits 0, 1, 2 = lerp, addcmul, addcdiv without the FMA; bit 3 = the reciprocal of
// the bias correction taken in float (see adamw_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include "adamw_cuda.h"

namespace leto_rmu_math {

template <bool FMA>
__device__ __forceinline__ float madd(float alpha, float x, float a) {  // a + alpha * x
  if constexpr (FMA) return __fmaf_rn(alpha, x, a);
  else return __fadd_rn(a, __fmul_rn(alpha, x));
}

// g * coef                                          mul (0-dim CUDA tensor operand)
__device__ __forceinline__ float grad(float g, float coef, const leto_rmu::AdamWScalars& s) {
  return s.has_coef ? __fmul_rn(g, coef) : g;
}

// m.lerp_(gc, w1)                                   lerp_ with |weight| < 0.5 (ATen Lerp.h)
template <int V>
__device__ __forceinline__ float exp_avg(float m, float gc, const leto_rmu::AdamWScalars& s) {
  return madd<!(V & 1)>(s.w1, __fsub_rn(gc, m), m);
}

// v.mul_(beta2).addcmul_(gc, gc, value=w2)
template <int V>
__device__ __forceinline__ float exp_avg_sq(float v, float gc, const leto_rmu::AdamWScalars& s) {
  v = __fmul_rn(v, s.beta2);
  return madd<!(V & 2)>(s.w2, __fmul_rn(gc, gc), v);
}

// p.mul_(decay); d = v.sqrt() / bc2_sqrt + eps; p.addcdiv_(m, d, value=nstep)  (m, v: the new ones)
template <int V>
__device__ __forceinline__ float param(float p, float m, float v, const leto_rmu::AdamWScalars& s) {
  if (s.has_decay) p = __fmul_rn(p, s.decay);
  float d = __fsqrt_rn(v);
  d = __fmul_rn(d, (V & 8) ? s.inv_bc2_f : s.inv_bc2);
  d = __fadd_rn(d, s.eps);
  return madd<!(V & 4)>(s.nstep, __fdiv_rn(m, d), p);
}

// The whole step of one element, in place.
template <int V>
__device__ __forceinline__ void step(float& p, float& m, float& v, float g, float coef,
                                     const leto_rmu::AdamWScalars& s) {
  const float gc = grad(g, coef, s);
  m = exp_avg<V>(m, gc, s);
  v = exp_avg_sq<V>(v, gc, s);
  p = param<V>(p, m, v, s);
}

}  // namespace leto_rmu_math
