// Extra launch variants of the syndrome_mix kernel (see parity_cuda.cu): "simple" reads pages
// straight from global memory (a cross-check of the cp.async pipeline), "nb2" uses 2-block tiles
// (128 threads), "rolled" does not unroll the page loop.  Benchmarks and tests select them.
#include "parity_cuda_kernels.cuh"

namespace leto_cuda {

void launch_variant(int variant, bool baked, const SyndromeArgs& a, const MixMasks& masks,
                    cudaStream_t stream) {
  if (variant == kVariantSimple) return launch_sm<4, false, false>(a, masks, stream);
  if (variant == kVariantRolled) {
    if (baked) return launch_sm<4, true, true, true>(a, masks, stream);
    return launch_sm<4, false, true, true>(a, masks, stream);
  }
  if (baked) return launch_sm<2, true, true>(a, masks, stream);
  return launch_sm<2, false, true>(a, masks, stream);
}

}  // namespace leto_cuda
