// RMU's chunk in one kernel with warp-specialized CTAs (layout `ws`).  Why: adamw_syndrome.cu's
// CTAs alternate between the AdamW phase (memory) and the Horner (ALU) behind CTA-wide
// barriers, so a chunk costs about the sum of the two (docs/BENCHMARKS.md).  Here one CTA owns
// a 2 KiB tile of all three states, and its warps have one job each:
//  * 4 producer warps (128 threads, 16 bytes of each page each): old p, m, v and g stream
//    into a ring of their own with cp.async (each thread reads back only what it loaded: no
//    barrier); they run AdamW, store the new states (and, fold, the old values to the undo
//    buffer) and leave the three states' deltas old ^ new in a shared ring;
//  * 12 Horner warps (3 states x 4 exponent groups, as adamw_onecta.cu) run the Horner on the
//    deltas.
// The shared ring's slots are handed over with named barriers (producers arrive on "full",
// the Horner warps sync on it; the reverse on "empty"), never a CTA-wide barrier, so the
// Horner of one stage overlaps the producers' loads and stores of the next ones.
// 512 threads at 128 registers: one CTA (16 warps) per SM, the whole register file.
//
// Fold with counts (the updater's folded chunk, leto_runtime/rmu/fold.py): a producer warp owns
// a 512-byte column ("unit") of every page.  At stage s each lane stores the stage's old values
// to the undo buffer, keeps the new ones in a private stash, fences, and after a __syncwarp
// lane 0 stores count = s + 1 (two copies); only then, after the next stage's fence and
// __syncwarp, does the warp store stage s's new values in place.  So at any instant, whatever
// stops the kernel: every stage below a unit's visible count has its undo copy complete, and no
// stage at or above it has a new value stored.  Recovery restores exactly those stages from the
// undo buffer.
//
// Reference: adamw_syndrome.cu (the same states and parity bits; with fold, on an undo copy
// made beforehand, whose bytes the undo buffer then holds).  Fused::syndrome_check and
// Fused::fold_check check it.
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adamw_fused_loop.cuh"
#include "adamw_syndrome.h"

namespace {

constexpr int kWsSets = 3;          // Horner thread sets: params, exp_avg, exp_avg_sq
constexpr int kProducers = 128;     // one 16-byte column of a 2 KiB tile each
constexpr int kIn = 4;              // the producers' input ring (stages)
constexpr int kDelta = 3;           // the shared delta ring (stages)

template <bool B>
using CfgWs = Cfg<2, 2, kDelta, true, true, B, false>;

template <class C, bool kCounts = false, int kBatch = 1>
struct WsSmem {
  static constexpr int kDeltaStage = kWsSets * C::kP * C::kPageSmem;       // 3 states' deltas
  static constexpr int kDeltaBytes = kDelta * kDeltaStage;
  static constexpr int kInSlot = kProducers * 16;                          // one input of one page
  static constexpr int kInStage = kInputs * C::kP * kInSlot;
  // fold with counts: each producer's new values of two batches of stages (stored one batch late)
  static constexpr int kStashStage = kWsSets * C::kP * kInSlot;
  static constexpr int kStash = kCounts ? 2 * kBatch * kStashStage : 0;
  static constexpr int kPipe = kDeltaBytes + kIn * kInStage + kStash;
  static constexpr int kBytes = kPipe > kWsSets * C::kSynBytes ? kPipe : kWsSets * C::kSynBytes;
  static constexpr int kThreads = kWsSets * C::kThreads + kProducers;
};

// Named barriers (0 is __syncthreads): slot k's "full" and "empty"; every thread takes part.
__device__ __forceinline__ int bar_full(int k) { return 1 + k; }
__device__ __forceinline__ int bar_empty(int k) { return 1 + kDelta + k; }
template <class C>
__device__ __forceinline__ void bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(WsSmem<C>::kThreads) : "memory");
}
template <class C>
__device__ __forceinline__ void bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(WsSmem<C>::kThreads) : "memory");
}

// A producer thread (pt = 0..127): its 16 bytes of every page of the tile.
// kBatch: stages per count (a fence and a count after every kBatch stages; the stash holds two
// batches).  The updater's kernel counts every stage (1) or every 4 (LETO_RMU_FOLD_BATCH=4); the
// benchmarks' build (adamw_ws_bench.cu) has 2 as well.
template <class C, int V, bool kFold, bool kCounts, int kBatch>
__device__ __forceinline__ void ws_produce(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, int pt,
                                           uint8_t* smem) {
  static_assert(!kCounts || kFold, "counts order the fold's stores");
  using S = WsSmem<C, kCounts, kBatch>;
  constexpr int NB = C::NB;
  const size_t tile_off = static_cast<size_t>(blockIdx.x) * NB * 1024;
  const int blocks = static_cast<int>(a.page_bytes / 1024);
  const int n_pad = (a.n + 15) & ~15;
  const int n_stages = n_pad / C::kP;
  const int cbl = pt / 64, cch = pt % 64;
  const bool cvalid = static_cast<int>(blockIdx.x) * NB + cbl < blocks;
  const size_t csrc = tile_off + static_cast<size_t>(cbl) * 1024 + cch * 16;
  const int cdst = cbl * C::kBlockStride + cch * 16;
  const float* const* src = kFold ? f.state : f.old;
  const uint8_t* in[kInputs] = {reinterpret_cast<const uint8_t*>(src[0]), reinterpret_cast<const uint8_t*>(src[1]),
                                reinterpret_cast<const uint8_t*>(src[2]), reinterpret_cast<const uint8_t*>(f.g)};
  const float coef = f.s.has_coef ? *f.coef : 1.0f;
  uint8_t* ring = smem + S::kDeltaBytes;
  auto page_of = [&](int s, int p) { return n_pad - 1 - (s * C::kP + p); };
  auto valid = [&](int j) { return j < a.n && cvalid; };
  auto islot = [&](int s, int i, int p) {
    return reinterpret_cast<float4*>(ring + (s % kIn) * S::kInStage + (i * C::kP + p) * S::kInSlot + pt * 16);
  };
  auto issue = [&](int s) {
    if (s < n_stages) {
#pragma unroll
      for (int p = 0; p < C::kP; ++p) {
        const int j = page_of(s, p);
        if (valid(j)) {
          const size_t off = static_cast<size_t>(j) * a.page_bytes + csrc;
#pragma unroll
          for (int i = 0; i < kInputs; ++i) cp_async16(islot(s, i, p), in[i] + off);
        }
      }
    }
    cp_async_commit();   // always, so that group counting stays uniform
  };
  auto store = [&](int y, int j, float4 v, bool undo) {
    float* base = undo ? (y == 0 ? f.undo[0] : (y == 1 ? f.undo[1] : f.undo[2]))
                       : (y == 0 ? f.state[0] : (y == 1 ? f.state[1] : f.state[2]));
    *reinterpret_cast<float4*>(reinterpret_cast<uint8_t*>(base) + static_cast<size_t>(j) * a.page_bytes + csrc) = v;
  };
  // Counts: this warp's unit; the stash slot of stage s's new value of state y, page p.
  const size_t unit = static_cast<size_t>(blockIdx.x) * (kProducers / 32) + pt / 32;
  auto stash = [&](int s, int y, int p) {
    return reinterpret_cast<float4*>(smem + S::kDeltaBytes + kIn * S::kInStage + (s % (2 * kBatch)) * S::kStashStage +
                                     (y * C::kP + p) * S::kInSlot + pt * 16);
  };
  auto store_new = [&](int s) {       // stage s's new values, from the stash
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = page_of(s, p);
      if (valid(j)) {
#pragma unroll
        for (int y = 0; y < 3; ++y) store(y, j, *stash(s, y, p), false);
      }
    }
  };
  auto count = [&](int s) {           // stages 0..s: undo copies visible (this warp), then counted
    __threadfence();
    __syncwarp();
    if (pt % 32 == 0) {
      const uint64_t c = (f.tag << 16) | static_cast<uint64_t>(s + 1);
      *reinterpret_cast<volatile uint64_t*>(f.counts[0] + unit) = c;
      *reinterpret_cast<volatile uint64_t*>(f.counts[1] + unit) = c;
    }
  };

#pragma unroll
  for (int s = 0; s < kIn - 1; ++s) issue(s);
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    issue(s + kIn - 1);                   // into stage s-1's slot, which this thread has read
    cp_async_wait<kIn - 1>();             // this thread's copies of stage s are in
    uint4 d[3][C::kP];
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      const int j = page_of(s, p);
      if (valid(j)) {
        const float4 g = *islot(s, 3, p);
        const float4 o[3] = {*islot(s, 0, p), *islot(s, 1, p), *islot(s, 2, p)};
        const float4 m = new_moment<V>(1, o[1], g, coef, f.s);
        const float4 v = new_moment<V>(2, o[2], g, coef, f.s);
        const float4 n[3] = {param_of<V>(o[0], m, v, f.s), m, v};
#pragma unroll
        for (int y = 0; y < 3; ++y) {
          if (kFold) store(y, j, o[y], true);
          if (kCounts) {
            *stash(s, y, p) = n[y];
          } else {
            store(y, j, n[y], false);
          }
          d[y][p] = xor_bits(o[y], n[y]);
        }
      } else {
#pragma unroll
        for (int y = 0; y < 3; ++y) d[y][p] = make_uint4(0u, 0u, 0u, 0u);   // a zero delta
      }
    }
    if constexpr (kCounts) {
      if (s % kBatch == kBatch - 1 || s == n_stages - 1) {
        count(s);                         // after this warp's fence and sync: the count of the
        const int b0 = s - s % kBatch;    // batch before was stored (lane 0) before its stages'
        for (int q = b0 - kBatch > 0 ? b0 - kBatch : 0; q < b0; ++q) store_new(q);   // new values
      }
    }
    const int k = s % kDelta;
    if (s >= kDelta) bar_sync<C>(bar_empty(k));   // the Horner warps are done with stage s - kDelta
    uint8_t* dst = smem + k * S::kDeltaStage + cdst;
#pragma unroll
    for (int y = 0; y < 3; ++y)
#pragma unroll
      for (int p = 0; p < C::kP; ++p) *reinterpret_cast<uint4*>(dst + (y * C::kP + p) * C::kPageSmem) = d[y][p];
    bar_arrive<C>(bar_full(k));
  }
  cp_async_wait<0>();
  if constexpr (kCounts) {
    if (n_stages > 0) {
      __threadfence();                    // lane 0's last count is visible first
      __syncwarp();
      for (int q = (n_stages - 1) - (n_stages - 1) % kBatch; q < n_stages; ++q) store_new(q);
    }
  }
  // Take the Horner warps' last arrivals, so that no named barrier is left half-way.
  for (int s = n_stages > kDelta ? n_stages - kDelta : 0; s < n_stages; ++s) bar_sync<C>(bar_empty(s % kDelta));
}

// A Horner thread of set y (= its state), group GI: the syndromes of its column.
template <class C, int GI>
__device__ __forceinline__ void ws_consume(const SyndromeArgs& a, int y, int col, uint8_t* smem,
                                           uint32_t (&acc)[4][16]) {
  using S = WsSmem<C>;
  const int bl = col / 16, q = col % 16;
  const int n_stages = ((a.n + 15) & ~15) / C::kP;
#pragma unroll 1
  for (int s = 0; s < n_stages; ++s) {
    const int k = s % kDelta;
    bar_sync<C>(bar_full(k));
    const uint8_t* d0 = smem + k * S::kDeltaStage + y * C::kP * C::kPageSmem + bl * C::kBlockStride + q * 4;
#pragma unroll
    for (int p = 0; p < C::kP; ++p) {
      uint32_t d[16];
#pragma unroll
      for (int r = 0; r < 16; ++r) d[r] = *reinterpret_cast<const uint32_t*>(d0 + p * C::kPageSmem + r * 64);
      group_step<GI>(acc, d);
    }
    bar_arrive<C>(bar_empty(k));
  }
}

template <class C, int V, bool kFold, bool kCounts, int kBatch>
__global__ void __launch_bounds__(WsSmem<C>::kThreads, 1)
    adamw_ws_kernel(const SyndromeArgs a_in, const leto_rmu::AdamWSyndromeArgs f,
                    const __grid_constant__ MixMasks masks) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int hthreads = kWsSets * C::kThreads;
  if (static_cast<int>(threadIdx.x) >= hthreads) {   // whole warps: the branch is warp-uniform
    ws_produce<C, V, kFold, kCounts, kBatch>(a_in, f, static_cast<int>(threadIdx.x) - hthreads, smem);
    __syncthreads();   // the rings are free (run_group_with's exchange reuses the memory)
    __syncthreads();   // run_group_with's exchange barrier
    return;
  }
  SyndromeArgs a = a_in;
  const int y = static_cast<int>(threadIdx.x) / C::kThreads;
  const int col = static_cast<int>(threadIdx.x) % 32;
  a.outs += static_cast<int64_t>(y) * a.m_out;
  a.bases += static_cast<int64_t>(y) * a.m_out;
  uint8_t* syn = smem + y * C::kSynBytes;
  auto loop = [&](auto gi) {
    return [&, gi](uint32_t (&acc)[4][16]) {
      ws_consume<C, decltype(gi)::value>(a, y, col, smem, acc);
      __syncthreads();   // every set's Horner is done: the rings are free for the exchange
    };
  };
  switch (thread_group()) {
    case 0: run_group_with<C, 0>(a, masks, syn, loop(std::integral_constant<int, 0>{}), col); break;
    case 1: run_group_with<C, 1>(a, masks, syn, loop(std::integral_constant<int, 1>{}), col); break;
    case 2: run_group_with<C, 2>(a, masks, syn, loop(std::integral_constant<int, 2>{}), col); break;
    default: run_group_with<C, 3>(a, masks, syn, loop(std::integral_constant<int, 3>{}), col); break;
  }
}

template <class C, bool kFold, bool kCounts = false, int kBatch = 1>
void launch_ws(const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
               cudaStream_t stream) {
  using S = WsSmem<C, kCounts, kBatch>;
  launch_tiles<C, adamw_ws_kernel<C, 0, kFold, kCounts, kBatch>>(S::kThreads, S::kBytes, a, f, masks, stream,
                                                                 "adamw_syndrome_ws kernel launch");
}

template <int kBatch>
void launch_counts(bool baked, const SyndromeArgs& a, const leto_rmu::AdamWSyndromeArgs& f, const MixMasks& masks,
                   cudaStream_t stream) {
  if (baked) {
    launch_ws<CfgWs<true>, true, true, kBatch>(a, f, masks, stream);
  } else {
    launch_ws<CfgWs<false>, true, true, kBatch>(a, f, masks, stream);
  }
}

}  // namespace

namespace leto_rmu {

void adamw_syndrome_ws(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, bool fold,
                       cudaStream_t stream) {
  SyndromeArgs a;
  MixMasks masks{};
  const float* undo[3] = {fold ? f.undo[0] : f.old[0], fold ? f.undo[1] : f.old[1], fold ? f.undo[2] : f.old[2]};
  bool baked = false;
  if (!prepare_chunk(args, f, undo, coef, a, masks, baked)) return;
  const bool counts = fold && f.counts[0] != nullptr;
  if (counts && (f.counts[1] == nullptr || f.tag >> 48 != 0))
    throw std::invalid_argument("adamw_syndrome_ws: counts need two copies and a tag below 2^48");
  const int batch = f.count_batch > 0 ? f.count_batch : 1;
  if (counts) {
    switch (batch) {
      case 1: launch_counts<1>(baked, a, f, masks, stream); return;
      case 4: launch_counts<4>(baked, a, f, masks, stream); return;
#ifdef LETO_WS_COUNT_BATCHES
      case 2: launch_counts<2>(baked, a, f, masks, stream); return;
#endif
      default: throw std::invalid_argument("adamw_syndrome_ws: no kernel counting every " + std::to_string(batch) +
                                           " stages in this build");
    }
  }
  switch ((baked ? 1 : 0) + (fold ? 2 : 0)) {
    case 0: launch_ws<CfgWs<false>, false>(a, f, masks, stream); break;
    case 1: launch_ws<CfgWs<true>, false>(a, f, masks, stream); break;
    case 2: launch_ws<CfgWs<false>, true>(a, f, masks, stream); break;
    default: launch_ws<CfgWs<true>, true>(a, f, masks, stream); break;
  }
}

}  // namespace leto_rmu
