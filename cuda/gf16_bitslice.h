// Bitsliced GF(2^16) arithmetic shared by the C++ CPU kernels and the CUDA kernels.
//
// Reference: leto_runtime/parity/reference.py (Horner on bit-planes) and docs/PARITY.md.
//
// A "word" W holds one bit of many symbols: plane r of a page slice.  W is uint32_t on the GPU
// (one 32-bit word of a 64-byte plane = one bit of 32 symbols) and a GCC vector of uint64_t on
// the CPU.  Sixteen words W[0..15] (planes 0..15) hold those symbols completely.
//
// Everything that depends on the field polynomial or on t is a compile-time constant here: the
// step "acc = acc * x^T + d" expands, per output plane, into the XOR of the input planes whose bit
// is set in the constant bit matrix of x^T (plus d).  With the loops unrolled the rotation part
// of that matrix is register renaming; only the reduction taps cost instructions.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__CUDACC__)
#define LETO_HD __host__ __device__ __forceinline__
#else
#define LETO_HD inline __attribute__((always_inline))
#endif
// Lambdas passed to static_for must inline into the (ISA-specific) caller on the CPU.
#if defined(__CUDACC__) || !defined(__GNUC__)
#define LETO_INL
#else
#define LETO_INL __attribute__((always_inline))
#endif
#define LETO_CV(x) std::decay_t<decltype(x)>::value
#if defined(__CUDACC__)
#define LETO_UNROLL _Pragma("unroll")
#elif defined(__clang__)
#define LETO_UNROLL _Pragma("clang loop unroll(full)")
#elif defined(__GNUC__)
#define LETO_UNROLL _Pragma("GCC unroll 16")
#else
#define LETO_UNROLL
#endif

namespace leto_gf {

constexpr uint32_t kPoly = 0x1002D;  // x^16 + x^5 + x^3 + x^2 + 1
constexpr int kTLo = -7;             // the kernels' exponent window t = -7..8 (covers T(m), m <= 16)
constexpr int kNT = 16;

// x^e for small |e| (|e| < 64), as a 16-bit element.  Used only in constant expressions.
LETO_HD constexpr uint32_t xpow(int e) {
  uint32_t a = 1;
  for (int i = 0; i < e; ++i) {  // multiply by x
    a <<= 1;
    if (a & 0x10000u) a ^= kPoly;
  }
  for (int i = 0; i < -e; ++i) {  // divide by x: x^-1 = x^15 + x^4 + x^2 + x
    a = (a & 1u) ? ((a ^ kPoly) >> 1) : (a >> 1);
  }
  return a;
}

// Bit (row r, column c) of the 16x16 GF(2) matrix of "multiply by x^T": column c is x^(T+c).
LETO_HD constexpr bool mulx_bit(int T, int r, int c) { return (xpow(T + c) >> r) & 1u; }

// static_for<N>(f) calls f(std::integral_constant<int, 0>) ... f(integral_constant<int, N-1>):
// indices are constant expressions, so `if constexpr` on table bits selects code at compile time.
template <class F, int... I>
LETO_HD void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
LETO_HD void static_for(F&& f) {
  static_for_impl(f, std::make_integer_sequence<int, N>{});
}

// The columns c with bit (r, c) set in the matrix of x^T, in order (a compile-time list).
struct RowCols {
  int n;
  int c[16];
};
LETO_HD constexpr RowCols row_cols(int T, int r) {
  RowCols rc{0, {}};
  for (int c = 0; c < 16; ++c)
    if (mulx_bit(T, r, c)) rc.c[rc.n++] = c;
  return rc;
}

// acc = acc * x^T  (+ d when HasData).  new[r] = d[r] ^ XOR_{c : bit(T,r,c)} acc[c], the inputs
// taken two at a time (v ^ (a ^ b)) so that each pair is one 3-input op (LOP3 / vpternlogq).
template <int T, bool HasData, class W>
LETO_HD void horner_step(W (&acc)[16], const W (&d)[16]) {
  W n[16];
  static_for<16>([&](auto r) LETO_INL {
    W v;
    if constexpr (HasData) v = d[LETO_CV(r)];
    else v = acc[row_cols(T, LETO_CV(r)).c[0]];
    static_for<8>([&](auto i) LETO_INL {
      // (Re)computed here: nvcc does not see a constexpr local of the enclosing lambda as constant.
      constexpr RowCols rc = row_cols(T, LETO_CV(r));
      constexpr int a = (HasData ? 0 : 1) + 2 * LETO_CV(i);
      if constexpr (a + 1 < rc.n) v ^= acc[rc.c[a]] ^ acc[rc.c[a + 1]];
      else if constexpr (a < rc.n) v ^= acc[rc.c[a]];
    });
    n[LETO_CV(r)] = v;
  });
  static_for<16>([&](auto r) LETO_INL { acc[LETO_CV(r)] = n[LETO_CV(r)]; });
}

// z = z * x  (rotation plus the three taps of x^16 = x^5 + x^3 + x^2 + 1).
template <class W>
LETO_HD void mul_x(W (&z)[16]) {
  W top = z[15];
  static_for<15>([&](auto i) LETO_INL { z[15 - LETO_CV(i)] = z[14 - LETO_CV(i)]; });
  z[0] = top;
  z[2] ^= top;
  z[3] ^= top;
  z[5] ^= top;
}

// acc[o] ^= c_o * z for NOUT runtime constants c_o given as bit masks: mask(o, b) is all-ones
// when bit b of c_o is set, else zero.  Shift-xor form: c*z = sum_b c_b * (x^b z), with x^b z
// built incrementally (one mul_x per bit, shared by the NOUT outputs).  Plain unrolled loops
// (not static_for) keep the number of template instantiations, and so compile time, small.
template <int NOUT, class W, class MaskF>
LETO_HD void mac_shift_xor(W (&acc)[NOUT][16], W (&z)[16], MaskF&& mask) {
  LETO_UNROLL
  for (int b = 0; b < 16; ++b) {
    LETO_UNROLL
    for (int o = 0; o < NOUT; ++o) {
      const W m = mask(o, b);
      LETO_UNROLL
      for (int r = 0; r < 16; ++r) acc[o][r] ^= z[r] & m;
    }
    if (b < 15) mul_x(z);
  }
}

// Host-side helpers ---------------------------------------------------------------------------
// Product a*b in GF(2^16) (bitwise; used to build bit matrices and masks, not in hot loops).
LETO_HD constexpr uint32_t gf_mul(uint32_t a, uint32_t b) {
  uint32_t r = 0;
  for (int i = 0; i < 16; ++i) {
    if (b & 1u) r ^= a;
    b >>= 1;
    a <<= 1;
    if (a & 0x10000u) a ^= kPoly;
  }
  return r;
}

}  // namespace leto_gf
