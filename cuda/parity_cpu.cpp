// C++ CPU parity kernels: syndrome_mix (encode / decode / scrub) and delta_update.
//
// Reference: leto_runtime/parity/reference.py; Python face: leto_runtime/parity/_ext.py
// (CpuKernels, through ctypes) and leto_runtime/parity/backends.py.
//
// The same kernels are compiled for three vector widths (16-byte baseline, AVX2, AVX-512F) and
// picked at run time with cpuid, so one build runs on any x86-64 host; XOR and AND are exact,
// so every width produces the same bytes.  On other architectures only the baseline exists
// (GCC vector extensions lower it to whatever the target has).  Threads: parallel_blocks below
// splits the blocks over the `threads` the caller passes (torch.get_num_threads() in Python),
// so torch.set_num_threads(1) gives the single-core figure.
//
// A plain shared library with a C ABI (no torch, no pybind): it compiles in seconds instead of
// the half minute torch's headers cost, and ctypes releases the GIL around every call.  Pages
// are passed as arrays of raw addresses: pages of one group need not be contiguous.  A zero
// address stands for an all-zero page.  The caller (Python) has checked sizes, dtypes and
// devices; nothing here allocates page memory.

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gf16_bitslice.h"

#ifndef LETO_CHUNK
#define LETO_CHUNK 8  // pages per L1 chunk (see parity_cpu_kernels.inc)
#endif

namespace {

thread_local int64_t g_threads = 1;  // set by each entry point from its caller's `threads`

// Runs fn(b0, b1) over [0, n) split into contiguous ranges on g_threads threads.  Small jobs
// (< ~4 MB touched) run inline.
template <class F>
void parallel_blocks(int64_t n, int64_t bytes_per_item, F&& fn) {
  const int64_t want = std::min<int64_t>(g_threads, n);
  const int64_t threads = std::min<int64_t>(want, std::max<int64_t>(1, n * bytes_per_item >> 22));
  if (threads <= 1) return fn(int64_t(0), n);
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t b = per; b < n; b += per) pool.emplace_back([&, b] { fn(b, std::min(n, b + per)); });
  fn(int64_t(0), std::min(n, per));
  for (auto& t : pool) t.join();
}

// For each output i and plane r: the (t, c) syndrome planes whose XOR gives plane r of
// sum_t coef[i][t] * S_t.  Bit r of coef*x^c is the (r, c) entry of coef's bit matrix.
struct MixPlan {
  std::vector<int> active;                    // t indices (0..15) with a non-zero column
  std::vector<std::vector<uint16_t>> rows;    // [i*16 + r] -> list of t*16 + c
};

MixPlan make_plan(const int32_t* coef, int64_t m_out) {
  MixPlan p;
  p.rows.resize(static_cast<size_t>(m_out) * 16);
  for (int t = 0; t < leto_gf::kNT; ++t) {
    bool any = false;
    for (int64_t i = 0; i < m_out; ++i) any |= coef[i * leto_gf::kNT + t] != 0;
    if (any) p.active.push_back(t);
  }
  for (int64_t i = 0; i < m_out; ++i) {
    for (int t : p.active) {
      uint32_t col = static_cast<uint32_t>(coef[i * leto_gf::kNT + t]) & 0xFFFFu;
      for (int c = 0; c < 16; ++c) {  // col = coef * x^c
        for (int r = 0; r < 16; ++r)
          if ((col >> r) & 1u) p.rows[i * 16 + r].push_back(static_cast<uint16_t>(t * 16 + c));
        col <<= 1;
        if (col & 0x10000u) col ^= leto_gf::kPoly;
      }
    }
  }
  return p;
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
#define LETO_ISA avx512
#define LETO_VBYTES 64
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
#define LETO_ISA avx2
#define LETO_VBYTES 32
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES
#pragma GCC pop_options
#define LETO_HAVE_X86_VARIANTS 1
#endif

#define LETO_ISA base
#define LETO_VBYTES 16
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES

namespace {

enum class Isa { kBase, kAvx2, kAvx512 };

Isa detect_isa() {
#ifdef LETO_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kBase;
}

Isa g_isa = detect_isa();

const char* isa_name(Isa i) {
  return i == Isa::kAvx512 ? "avx512" : i == Isa::kAvx2 ? "avx2" : "base";
}

// For tests and benchmarks: force a narrower variant (never a wider one than the CPU has).
// Returns false for an unknown name.
bool set_isa(const char* name) {
  const std::string n = name ? name : "";
  if (n != "avx512" && n != "avx2" && n != "base" && n != "auto") return false;
  const Isa best = detect_isa();
  Isa want = n == "avx512" ? Isa::kAvx512 : n == "avx2" ? Isa::kAvx2 : Isa::kBase;
  if (n == "auto" || static_cast<int>(want) > static_cast<int>(best)) want = best;
  g_isa = want;
  return true;
}

}  // namespace

// The C ABI (leto_runtime/parity/_ext.py binds it).  Entry points return 0, or -1 when an
// argument is out of contract (the Python side checks first; this is the last line).
extern "C" {

const char* leto_parity_isa() { return isa_name(g_isa); }

const char* leto_parity_set_isa(const char* name) {
  return set_isa(name) ? isa_name(g_isa) : nullptr;
}

// outs[i] = sum_t coef[i][t] * S_t(pages), coef: m_out x 16 (the t = -7..8 window).
int leto_parity_syndrome_mix(const uint8_t* const* pages, int64_t n, uint8_t* const* outs,
                             int64_t m_out, const int32_t* coef, int64_t page_bytes,
                             int64_t threads) {
  if (page_bytes <= 0 || page_bytes % 1024 != 0 || n < 0 || m_out < 0 || !coef) return -1;
  g_threads = std::max<int64_t>(1, threads);
  const MixPlan plan = make_plan(coef, m_out);
  const size_t S = static_cast<size_t>(page_bytes);
  switch (g_isa) {
#ifdef LETO_HAVE_X86_VARIANTS
    case Isa::kAvx512: avx512::syndrome_mix(pages, n, outs, m_out, plan, S); return 0;
    case Isa::kAvx2: avx2::syndrome_mix(pages, n, outs, m_out, plan, S); return 0;
#endif
    default: base::syndrome_mix(pages, n, outs, m_out, plan, S); return 0;
  }
}

// outs[i] ^= sum_l coef[i][l] * (a[l] ^ b[l]), coef: m_out x n.
int leto_parity_delta_update(uint8_t* const* outs, int64_t m_out, const uint8_t* const* a,
                             const uint8_t* const* b, int64_t n, const int32_t* coef,
                             int64_t page_bytes, int64_t threads) {
  if (page_bytes <= 0 || page_bytes % 1024 != 0 || n < 0 || m_out < 0 || !coef) return -1;
  g_threads = std::max<int64_t>(1, threads);
  std::vector<uint16_t> c(static_cast<size_t>(m_out * n));
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(coef[i]);
  const size_t S = static_cast<size_t>(page_bytes);
  switch (g_isa) {
#ifdef LETO_HAVE_X86_VARIANTS
    case Isa::kAvx512: avx512::delta_update(outs, m_out, a, b, n, c.data(), S); return 0;
    case Isa::kAvx2: avx2::delta_update(outs, m_out, a, b, n, c.data(), S); return 0;
#endif
    default: base::delta_update(outs, m_out, a, b, n, c.data(), S); return 0;
  }
}

}  // extern "C"
