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
  float* undo[3];         // the fold kernel's undo copies (written: the values before this step)
  uint32_t* progress;     // the fold kernel's stage counts, [3][tiles] (zeroed before; or null)
  // adamw_ws.cu's fold with counts (the updater's folded chunk): per 512-byte column ("unit") u
  // of a page, counts[c][u] = (tag << 16) | the 2-page stages whose undo copy is visible, in
  // two copies c (separate pages: one can be lost); a stage's new values are stored only after
  // its count is visible.  Null: no counts.
  uint64_t* counts[2];
  uint64_t tag;           // < 2^48: the transaction (leto_runtime/rmu/fold.py)
  int count_batch;        // stages per count (0 or 1: every stage; 4; 2: the benchmarks' build)
  const float* g;         // the chunk's gradients
  const float* coef;      // 0-dim fp32 on the device (clipping), or null
  AdamWScalars s;
};

// For the chunk of args.n pages: state <- AdamW(old, g) and, per state y, the 16 parity pages
// outs[y] = bases[y] ^ sum_t coef[i][t] scale[t] S_t(old_y ^ new_y) (args as for syndrome_mix:
// outs/bases device arrays of 3 x m_out page addresses, scale = the run offset's x^(f t)).
// Throws std::runtime_error on a bad argument or launch error.
// layout: the kernel's tiling and grid order (adamw_syndrome.cu, 0..3; 4: adamw_ws.cu's
// warp-specialized CTAs; all give the same bits).
void adamw_syndrome(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int variant,
                    int layout, cudaStream_t stream);

// The same chunk with the undo copy folded in (adamw_fold.cu): reads the states in place (f.old
// unused), writes their old values to f.undo and the new ones in place.  f.progress (if set):
// per state and 4 KiB tile, the number of 2-page stages (pages n_pad-1-2s, n_pad-2-2s, n_pad =
// n rounded up to 16) whose undo copy is visible; no new value of a stage is stored before
// the count includes it.  Layout 0; needs sm_90 (clusters).
void adamw_syndrome_fold(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, int device,
                         cudaStream_t stream);

// The same chunk with one CTA per 2 KiB tile for all three states (adamw_onecta.cu): old values
// from f.old (fold = false) or, with fold, read in place and written to f.undo.
void adamw_syndrome_onecta(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, bool fold,
                           cudaStream_t stream);

// The same chunk with warp-specialized CTAs (adamw_ws.cu): one CTA per 2 KiB tile, producer
// warps for AdamW and the memory traffic, Horner warps fed through a shared ring; f.old / fold
// as adamw_syndrome_onecta; with fold and f.counts set, the stage counts above.
void adamw_syndrome_ws(const SyndromeArgs& args, const AdamWSyndromeArgs& f, const uint16_t* coef, bool fold,
                       cudaStream_t stream);

}  // namespace leto_rmu
