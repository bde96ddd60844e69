// Fused AdamW chunk update for the Resumable Model Updater, with the chunk's delta pages.
//
// Reference: leto_runtime/rmu/adamw.py `adamw_chunk_` (torch ops), itself bit-identical to
// torch.optim.AdamW(foreach=False, fused=False) after clip_grad_norm_.  This kernel runs, per
// element, the same float operations in the same order, each written as the expression of the
// ATen CUDA kernel it replaces (so nvcc contracts the same multiply-adds into FMAs):
//
//   gc = g * coef                                  mul (0-dim CUDA tensor operand)
//   p  = p * decay                                 mul_(Python scalar) -> float(1 - lr*wd)
//   m  = m + w1 * (gc - m)                         lerp_ with |weight| < 0.5 (ATen Lerp.h)
//   v  = v * beta2                                 mul_(Python scalar)
//   v  = v + w2 * (gc * gc)                        addcmul_ (PointwiseOpsKernel.cu)
//   d  = sqrt(v) * inv_bc2                         div by a CPU scalar = mul by its reciprocal
//                                                  (BinaryDivTrueKernel.cu), inv = float(1.0 / x)
//                                                  (the double reciprocal, measured on torch 2.11)
//   d  = d + 1.0f * eps                            add_(Python scalar), alpha 1 (AddFunctor)
//   p  = p + nstep * (m / d)                       addcdiv_ (PointwiseOpsKernel.cu)
//
// `variant` selects other spellings for cross-checks (tests/gpu/test_rmu_fused_gpu.py reports
// which match torch on the machine): bits 0, 1, 2 = lerp, addcmul, addcdiv without the FMA;
// bit 3 = the reciprocal taken in float (1.0f / float(x)).  The updater uses variant 0 and only after the
// self-check (leto_runtime/rmu/fused.py) found it bit-identical to the reference on the device.
//
// Besides the new p, m, v it can write the delta pages D = old ^ new (as bit patterns) of each
// state, which the parity delta (syndrome path) reads instead of a separate XOR pass.  The
// gradients are never written, so an interrupted chunk is redone from its undo copy.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_cuda.h"
#include "adamw_math.cuh"

namespace {

// The per-element math lives in adamw_math.cuh (shared with adamw_syndrome.cu).
template <int V>
__device__ __forceinline__ void one(float& p, float& m, float& v, float g, float coef,
                                    const leto_rmu::AdamWScalars& s) {
  leto_rmu_math::step<V>(p, m, v, g, coef, s);
}

__device__ __forceinline__ uint32_t bits(float x) { return __float_as_uint(x); }

template <int V, bool DELTA>
__global__ void __launch_bounds__(256) adamw_kernel(leto_rmu::AdamWArgs a) {
  const float coef = a.s.has_coef ? *a.coef : 1.0f;
  const int64_t n4 = a.n / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  float4* p4 = reinterpret_cast<float4*>(a.p);
  float4* m4 = reinterpret_cast<float4*>(a.m);
  float4* v4 = reinterpret_cast<float4*>(a.v);
  const float4* g4 = reinterpret_cast<const float4*>(a.g);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4; i += stride) {
    float4 p = p4[i], m = m4[i], v = v4[i];
    const float4 g = __ldg(g4 + i);
    const float4 p0 = p, m0 = m, v0 = v;
    one<V>(p.x, m.x, v.x, g.x, coef, a.s);
    one<V>(p.y, m.y, v.y, g.y, coef, a.s);
    one<V>(p.z, m.z, v.z, g.z, coef, a.s);
    one<V>(p.w, m.w, v.w, g.w, coef, a.s);
    p4[i] = p;
    m4[i] = m;
    v4[i] = v;
    if constexpr (DELTA) {
      reinterpret_cast<uint4*>(a.dp)[i] = make_uint4(bits(p0.x) ^ bits(p.x), bits(p0.y) ^ bits(p.y),
                                                     bits(p0.z) ^ bits(p.z), bits(p0.w) ^ bits(p.w));
      reinterpret_cast<uint4*>(a.dm)[i] = make_uint4(bits(m0.x) ^ bits(m.x), bits(m0.y) ^ bits(m.y),
                                                     bits(m0.z) ^ bits(m.z), bits(m0.w) ^ bits(m.w));
      reinterpret_cast<uint4*>(a.dv)[i] = make_uint4(bits(v0.x) ^ bits(v.x), bits(v0.y) ^ bits(v.y),
                                                     bits(v0.z) ^ bits(v.z), bits(v0.w) ^ bits(v.w));
    }
  }
  // The tail (n % 4 elements), by the first threads of block 0.
  if (blockIdx.x == 0) {
    for (int64_t e = n4 * 4 + threadIdx.x; e < a.n; e += blockDim.x) {
      float p = a.p[e], m = a.m[e], v = a.v[e];
      const float p0 = p, m0 = m, v0 = v;
      one<V>(p, m, v, a.g[e], coef, a.s);
      a.p[e] = p;
      a.m[e] = m;
      a.v[e] = v;
      if constexpr (DELTA) {
        reinterpret_cast<uint32_t*>(a.dp)[e] = bits(p0) ^ bits(p);
        reinterpret_cast<uint32_t*>(a.dm)[e] = bits(m0) ^ bits(m);
        reinterpret_cast<uint32_t*>(a.dv)[e] = bits(v0) ^ bits(v);
      }
    }
  }
}

template <int V>
void launch_v(const leto_rmu::AdamWArgs& a, int blocks, cudaStream_t stream) {
  if (a.dp) adamw_kernel<V, true><<<blocks, 256, 0, stream>>>(a);
  else adamw_kernel<V, false><<<blocks, 256, 0, stream>>>(a);
}

}  // namespace

namespace leto_rmu {

void adamw_fused(const AdamWArgs& a, int variant, int sm_count, cudaStream_t stream) {
  if (a.n <= 0) return;
  for (const void* ptr : {static_cast<const void*>(a.p), static_cast<const void*>(a.m),
                          static_cast<const void*>(a.v), static_cast<const void*>(a.g)})
    if (reinterpret_cast<uintptr_t>(ptr) % 16) throw std::runtime_error("adamw_fused: p, m, v, g must be 16-byte aligned");
  if (a.dp && (reinterpret_cast<uintptr_t>(a.dp) % 16 || reinterpret_cast<uintptr_t>(a.dm) % 16 ||
               reinterpret_cast<uintptr_t>(a.dv) % 16))
    throw std::runtime_error("adamw_fused: the delta outputs must be 16-byte aligned");
  // Enough resident threads to cover HBM latency (8 CTAs of 256 per SM), never more than the work.
  const int64_t want = (a.n / 4 + 255) / 256;
  const int blocks = static_cast<int>(want < 1 ? 1 : (want < 8LL * sm_count ? want : 8LL * sm_count));
  switch (variant) {
    case 0: launch_v<0>(a, blocks, stream); break;
    case 1: launch_v<1>(a, blocks, stream); break;
    case 2: launch_v<2>(a, blocks, stream); break;
    case 3: launch_v<3>(a, blocks, stream); break;
    case 4: launch_v<4>(a, blocks, stream); break;
    case 5: launch_v<5>(a, blocks, stream); break;
    case 6: launch_v<6>(a, blocks, stream); break;
    case 7: launch_v<7>(a, blocks, stream); break;
    case 8: launch_v<8>(a, blocks, stream); break;
    case 9: launch_v<9>(a, blocks, stream); break;
    case 10: launch_v<10>(a, blocks, stream); break;
    case 11: launch_v<11>(a, blocks, stream); break;
    case 12: launch_v<12>(a, blocks, stream); break;
    case 13: launch_v<13>(a, blocks, stream); break;
    case 14: launch_v<14>(a, blocks, stream); break;
    case 15: launch_v<15>(a, blocks, stream); break;
    default: throw std::runtime_error("adamw_fused: variant must be 0..15, got " + std::to_string(variant));
  }
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string("adamw_fused launch: ") + cudaGetErrorString(e));
}

}  // namespace leto_rmu
