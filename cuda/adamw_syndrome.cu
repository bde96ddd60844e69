// RMU's chunk update in one pass: AdamW of the chunk and the parity delta of its three states,
// without the delta pages ever going through memory (docs/RMU.md, "The parity delta update";
// what the separate passes cost: docs/BENCHMARKS.md, "RMU steady-state overhead").
//
// References: the two-kernel path it replaces, bit for bit -- adamw_cuda.cu (new p, m, v and the
// delta pages old ^ new) followed by parity_cuda's syndrome_mix over those deltas with the run
// scale and base pages (Q' = Q ^ M diag(x^(f t)) S(delta)); and through them
// leto_runtime/rmu/adamw.py `adamw_chunk_` and leto_runtime/parity/reference.py.
//
// Grid: (tiles of NB KiB of a page, 3 states); the page loop (adamw_fused_loop.cuh) says what
// each CTA reads and writes.  Memory per chunk element: reads of g and old values (8 floats over
// the 3 CTAs), writes of the 3 new values; the two-kernel path also writes and re-reads the 3
// delta values.  adamw_fold.cu is the same chunk with the undo copy folded in.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_fused_loop.cuh"
#include "adamw_syndrome.h"

namespace {

template <class C, int V>
__global__ void __launch_bounds__(C::kThreads, C::kMinBlocks)
    adamw_syndrome_kernel(const SyndromeArgs a_in, const leto_rmu::AdamWSyndromeArgs f,
                          const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  SyndromeArgs a = a_in;
  const int y = static_cast<int>(C::kTileY ? blockIdx.x : blockIdx.y);
  a.outs += static_cast<int64_t>(y) * a.m_out;
  a.bases += static_cast<int64_t>(y) * a.m_out;
  switch (thread_group()) {
    case 0: run_group_with<C, 0>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 0, V, false, false>(a, f, y, smem, acc); }); break;
    case 1: run_group_with<C, 1>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 1, V, false, false>(a, f, y, smem, acc); }); break;
    case 2: run_group_with<C, 2>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 2, V, false, false>(a, f, y, smem, acc); }); break;
    default: run_group_with<C, 3>(a, masks, smem, [&](uint32_t (&acc)[4][16]) { fused_loop<C, 3, V, false, false>(a, f, y, smem, acc); }); break;
  }
}

template <class C>
void launch_fused(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
                  cudaStream_t stream) {
  auto kern = adamw_syndrome_kernel<C, 0>;
  constexpr int smem = FusedSmem<C>::kBytes;
  static bool attr = [&] {  // > 48 KB of dynamic shared memory needs an explicit opt-in
    check(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "cudaFuncSetAttribute");
    return true;
  }();
  (void)attr;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const unsigned tiles = static_cast<unsigned>((blocks + C::NB - 1) / C::NB);
  if (C::kTileY && tiles > 65535u) throw std::runtime_error("adamw_syndrome: a state-major grid holds 65535 tiles");
  const dim3 grid = C::kTileY ? dim3(3, tiles) : dim3(tiles, 3);
  kern<<<grid, C::kThreads, smem, stream>>>(a, f, masks);
  check(cudaGetLastError(), "adamw_syndrome kernel launch");
}

}  // namespace

namespace leto_rmu {

void adamw_syndrome(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int variant,
                    int layout, cudaStream_t stream) {
  if (variant != 0) throw std::runtime_error("adamw_syndrome: only AdamW spelling (variant) 0 is compiled");
  if (layout < 0 || layout > 4) throw std::runtime_error("adamw_syndrome: layout must be 0..4");
  if (layout == 4) return adamw_syndrome_ws(args, f, coef, false, stream);   // adamw_ws.cu
  SyndromeArgs a;
  MixMasks masks{};
  const float* undo[3] = {f.old[0], f.old[1], f.old[2]};
  bool baked = false;
  if (!prepare_chunk(args, f, undo, coef, a, masks, baked)) return;
  switch (layout * 2 + (baked ? 1 : 0)) {
    case 0: launch_fused<CfgFused<false>>(a, f, masks, stream); break;
    case 1: launch_fused<CfgFused<true>>(a, f, masks, stream); break;
    case 2: launch_fused<StateMajor<CfgFused<false>>>(a, f, masks, stream); break;
    case 3: launch_fused<StateMajor<CfgFused<true>>>(a, f, masks, stream); break;
    case 4: launch_fused<CfgFusedNarrow<false>>(a, f, masks, stream); break;
    case 5: launch_fused<CfgFusedNarrow<true>>(a, f, masks, stream); break;
    case 6: launch_fused<StateMajor<CfgFusedNarrow<false>>>(a, f, masks, stream); break;
    default: launch_fused<StateMajor<CfgFusedNarrow<true>>>(a, f, masks, stream); break;
  }
}

}  // namespace leto_rmu
