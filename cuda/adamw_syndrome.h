// Launch interface of the AdamW + parity-syndrome chunk kernel (adamw_syndrome.cu), used by
// adamw_binding.cpp.  Plain CUDA types only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "adamw_cuda.h"
#include "parity_cuda.h"

namespace leto_rmu {

struct AdamWSyndromeArgs {
  float* state[3];        // the chunk of params, exp_avg, exp_avg_sq (written: the new values)
  const float* old[3];    // their undo copies (read: the values before this step)
  const float* g;         // the chunk's gradients
  const float* coef;      // 0-dim fp32 on the device (clipping), or null
  AdamWScalars s;
};

// For the chunk of args.n pages: state <- AdamW(old, g) and, per state y, the 16 parity pages
// outs[y] = bases[y] ^ sum_t coef[i][t] scale[t] S_t(old_y ^ new_y) (args as for syndrome_mix:
// outs/bases device arrays of 3 x m_out page addresses, scale = the run offset's x^(f t)).
// Throws std::runtime_error on a bad argument or launch error.
// layout: the kernel's tiling and grid order (adamw_syndrome.cu, 0..3; all give the same bits).
void adamw_syndrome(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int variant,
                    int layout, cudaStream_t stream);

}  // namespace leto_rmu
