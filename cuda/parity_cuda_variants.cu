// Extra launch variants of the syndrome_mix kernel (Cfg* in parity_cuda_kernels.cuh): "simple"
// reads pages straight from global memory (a cross-check of the cp.async pipeline), "nb2" uses
// 2-block tiles (128 threads, 4 CTAs per SM), "plain" is the default without ZFILL, "unrolled" a
// page loop unrolled over a whole rotation period.  Benchmarks and tests select them explicitly.
#include "parity_cuda_kernels.cuh"

namespace leto_cuda {

void launch_variant(int variant, bool baked, const SyndromeArgs& a, const MixMasks& masks,
                    cudaStream_t stream) {
  switch (variant) {
    case kVariantSimple: return launch_sm<CfgSimple>(a, masks, stream);
    case kVariantNB2: return baked ? launch_sm<CfgNB2<true>>(a, masks, stream) : launch_sm<CfgNB2<false>>(a, masks, stream);
    case kVariantPlain: return baked ? launch_sm<CfgPlain<true>>(a, masks, stream) : launch_sm<CfgPlain<false>>(a, masks, stream);
    case kVariantUnrolled: return baked ? launch_sm<CfgUnrolled<true>>(a, masks, stream) : launch_sm<CfgUnrolled<false>>(a, masks, stream);
    default: throw std::runtime_error("unknown kernel variant " + std::to_string(variant));
  }
}

}  // namespace leto_cuda
