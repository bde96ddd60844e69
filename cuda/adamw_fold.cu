// RMU's chunk update with the undo copy folded in: the one-kernel chunk of adamw_syndrome.cu
// (AdamW of the chunk and the parity delta of its three states), except that each CTA reads its
// state in place and writes the old values to the undo buffer itself, so the separate undo copy
// (24 bytes per parameter) goes.  The three CTAs of a tile are a thread-block cluster: the
// params CTA takes the new moments from its peers' shared memory (adamw_fused_loop.cuh).
//
// References: adamw_syndrome.cu run on an undo copy made beforehand (new states and parity
// pages bit for bit; the undo buffer then equals the copy), and through it the two-kernel path
// and leto_runtime/rmu/adamw.py `adamw_chunk_`.
//
// Per chunk element: reads of p, m, v and g twice (the moments' CTAs; the second from L2 when
// the cluster runs in step), writes of the 3 new and the 3 old values: ~44 bytes per
// parameter against the copy (24) plus the copy kernel (44).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_fused_loop.cuh"
#include "adamw_syndrome.h"

namespace {

template <class C, int V, bool kProgress>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    adamw_fold_kernel(const SyndromeArgs a_in, const leto_rmu::AdamWSyndromeArgs f,
                      const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  SyndromeArgs a = a_in;
  const int y = static_cast<int>(blockIdx.y);   // = the CTA's rank in its cluster of (1, 3, 1)
  a.outs += static_cast<int64_t>(y) * a.m_out;
  a.bases += static_cast<int64_t>(y) * a.m_out;
  switch (thread_group()) {
    case 0: run_group_with<C, 0>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 0, V, true, kProgress>(a, f, y, smem, acc); }); break;
    case 1: run_group_with<C, 1>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 1, V, true, kProgress>(a, f, y, smem, acc); }); break;
    case 2: run_group_with<C, 2>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 2, V, true, kProgress>(a, f, y, smem, acc); }); break;
    default: run_group_with<C, 3>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 3, V, true, kProgress>(a, f, y, smem, acc); }); break;
  }
}

template <class C, bool kProgress>
void launch_fold(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
                 cudaStream_t stream) {
  auto kern = adamw_fold_kernel<C, 0, kProgress>;
  constexpr int smem = FusedSmem<C>::kBytes;
  static bool attr = [&] {  // > 48 KB of dynamic shared memory needs an explicit opt-in
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
    return true;
  }();
  (void)attr;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const unsigned tiles = static_cast<unsigned>((blocks + C::NB - 1) / C::NB);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(tiles, 3);
  cfg.blockDim = dim3(C::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attrs[1];
  attrs[0].id = cudaLaunchAttributeClusterDimension;
  attrs[0].val.clusterDim.x = 1;
  attrs[0].val.clusterDim.y = 3;
  attrs[0].val.clusterDim.z = 1;
  cfg.attrs = attrs;
  cfg.numAttrs = 1;
  check(cudaLaunchKernelEx(&cfg, kern, a, f, masks), "adamw_syndrome_fold kernel launch");
}

}  // namespace

namespace leto_rmu {

void adamw_syndrome_fold(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int device,
                         cudaStream_t stream) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "cudaDeviceGetAttribute");
  if (major < 9) throw std::runtime_error("adamw_syndrome_fold: needs thread-block clusters (sm_90 or newer)");
  SyndromeArgs a;
  MixMasks masks{};
  const float* undo[3] = {f.undo[0], f.undo[1], f.undo[2]};
  bool baked = false;
  if (!prepare_chunk(args, f, undo, coef, a, masks, baked)) return;
  switch ((baked ? 1 : 0) + (f.progress ? 2 : 0)) {
    case 0: launch_fold<CfgFused<false>, false>(a, f, masks, stream); break;
    case 1: launch_fold<CfgFused<true>, false>(a, f, masks, stream); break;
    case 2: launch_fold<CfgFused<false>, true>(a, f, masks, stream); break;
    default: launch_fold<CfgFused<true>, true>(a, f, masks, stream); break;
  }
}

}  // namespace leto_rmu
