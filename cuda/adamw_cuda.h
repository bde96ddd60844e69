// Launch interface of the fused AdamW chunk kernel (adamw_cuda.cu), used by adamw_binding.cpp.
// Plain CUDA types only.  Reference: leto_runtime/rmu/adamw.py `adamw_chunk_`.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace leto_rmu {

// The step's scalars, converted on the host exactly as torch converts its Python scalars.
struct AdamWScalars {
  float decay;      // float(1 - lr * weight_decay)                  (has_decay: weight_decay != 0)
  float w1;         // float(1 - beta1)                              lerp weight
  float beta2;      // float(beta2)
  float w2;         // float(1 - beta2)                              addcmul value
  float inv_bc2;    // float(1.0 / bias_correction2 ** 0.5)          div by a CPU scalar
  float inv_bc2_f;  // 1.0f / float(bias_correction2 ** 0.5)          (variant bit 3 only)
  float eps;        // float(eps)
  float nstep;      // float(-(lr / bias_correction1))                addcdiv value
  int has_coef;     // gradients are multiplied by *coef (clipping on)
  int has_decay;
};

struct AdamWArgs {
  float* p;
  float* m;
  float* v;
  const float* g;
  const float* coef;   // 0-dim fp32 on the device, or null (no clipping)
  uint32_t* dp;        // delta outputs old ^ new of p, m, v (all null: not written)
  uint32_t* dm;
  uint32_t* dv;
  int64_t n;
  AdamWScalars s;
};

// Queues the update on `stream`; throws std::runtime_error on a bad argument or launch error.
void adamw_fused(const AdamWArgs& a, int variant, int sm_count, cudaStream_t stream);

}  // namespace leto_rmu
