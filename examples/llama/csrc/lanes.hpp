// Native vectors of floats for the Llama example's CPU kernels (`decode_attention.cpp`,
// `next_tokens.cpp`): GCC's and Clang's vector extensions at the widths of SSE (4 floats), AVX2 (8)
// and AVX-512 (16), and Cephes' `expf` written so that it vectorises. A kernel is written once on
// `Native<N>` and compiled for each width under `__attribute__((target(...)))`, the widest the
// CPU has picked at run time (`TOPR_X86_DISPATCH`); elsewhere the 4-float version runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define TOPR_X86_DISPATCH 1
#endif

namespace topr::lanes {

// The lanes of a group (`Lanes`): the width every version's sums are written for.
constexpr int64_t LANES = 16;

// Whether this CPU runs a kernel's version on native vectors of `width` floats (4: every CPU).
inline bool runs_width(int width) {
#ifdef TOPR_X86_DISPATCH
  if (width == 16) return __builtin_cpu_supports("avx512f");
  if (width == 8) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return width == 4;
}

// `width`, or for 0 the widest vectors this CPU has.
inline int chosen_width(int width) {
  if (width != 0) return width;
  return runs_width(16) ? 16 : runs_width(8) ? 8 : 4;
}

template <int N>
struct Native;
template <>
struct Native<16> {
  typedef float f __attribute__((vector_size(64)));
  typedef int32_t i __attribute__((vector_size(64)));
};
template <>
struct Native<8> {
  typedef float f __attribute__((vector_size(32)));
  typedef int32_t i __attribute__((vector_size(32)));
};
template <>
struct Native<4> {
  typedef float f __attribute__((vector_size(16)));
  typedef int32_t i __attribute__((vector_size(16)));
};
typedef Native<8>::f v8;
typedef Native<4>::f v4;

template <typename T>
__attribute__((always_inline)) inline T load_as(const float* p) {
  T x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

template <typename T>
__attribute__((always_inline)) inline void store_as(float* p, T x) {
  std::memcpy(p, &x, sizeof x);
}

// 16 float lanes as `P = 16 / N` native vectors: lanes `p·N .. p·N + N` in `x[p]`.
template <int N>
struct Lanes {
  typedef typename Native<N>::f F;
  static constexpr int P = LANES / N;
  F x[P];

  __attribute__((always_inline)) static Lanes load(const float* s) {
    Lanes r;
    for (int p = 0; p < P; ++p) r.x[p] = load_as<F>(s + p * N);
    return r;
  }
  __attribute__((always_inline)) void store(float* s) const {
    for (int p = 0; p < P; ++p) store_as(s + p * N, x[p]);
  }
  __attribute__((always_inline)) static Lanes splat(float a) {
    Lanes r;
    for (int p = 0; p < P; ++p) r.x[p] = F{} + a;
    return r;
  }
  // The lanes' sum: halves added (lanes 0–7 and 8–15), then quarters, then the last four in pairs.
  __attribute__((always_inline)) float sum() const {
    v8 h;
    if constexpr (N == 16) {
      h = __builtin_shufflevector(x[0], x[0], 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(x[0], x[0], 8, 9, 10, 11, 12, 13, 14, 15);
    } else if constexpr (N == 8) {
      h = x[0] + x[1];
    } else {
      const v4 a = x[0] + x[2], b = x[1] + x[3];
      h = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7);
    }
    const v4 c = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
  }
  __attribute__((always_inline)) float max() const {
    float m = x[0][0];
    for (int p = 0; p < P; ++p)
      for (int u = 0; u < N; ++u) m = x[p][u] > m ? x[p][u] : m;
    return m;
  }
};

// `e^r` of the remainder `r = x − n·ln 2` (ln 2 in two parts, for exactness) of a whole `n`
// (x·log₂e rounded): Cephes' degree-6 polynomial for `expf`. `T` is `float` or a vector of floats.
template <typename T>
__attribute__((always_inline)) inline T exp_remainder(T x, T n) {
  T r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// `e^x` for `x ≤ 0` (a softmax's shifted scores), written so that the compiler vectorises a loop
// of it: Cephes' `expf` (range reduction by ln 2, the polynomial above, the power of two set in
// the exponent bits), within about 2 ulp of `std::exp`; 0 below −87 (where `e^x` is below f32's
// normal range), NaN for NaN (which never reaches the integer conversion).
inline float exp_nonpositive(float x) {
  const bool nan = x != x;
  const bool big = x < -87.0f;
  x = big || nan ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float e = exp_remainder(x, n);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return nan ? std::numeric_limits<float>::quiet_NaN() : big ? 0.0f : e * two_n;
}

// `e^x` for `x ≤ 0` on a native vector: `exp_nonpositive` lane by lane.
template <int N>
__attribute__((always_inline)) inline typename Native<N>::f exp_lanes(typename Native<N>::f x) {
  typedef typename Native<N>::f F;
  typedef typename Native<N>::i I;
  const F lowest = F{} - 87.0f;
  const auto nan = x != x;
  const auto big = x < lowest;
  x = (big | nan) ? lowest : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  F n = __builtin_convertvector(__builtin_convertvector(t, I), F);  // toward zero
  n = t < n ? n - 1.0f : n;                                         // floor
  const F e = exp_remainder(x, n);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return nan ? F{} + std::numeric_limits<float>::quiet_NaN() : big ? F{} : e * two_n;
}

}  // namespace topr::lanes
