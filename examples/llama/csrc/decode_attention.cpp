// Attention of a decoding step on the CPU: one new query per slot over the keys that slot may see,
// computed slot by slot and head group by head group, in f32, for the Llama example's generation
// (`src/attention.rs`).
//
// A decoding step's attention is, per slot and key head, `g` queries (the query heads that share
// the key head) against the slot's `n` cached keys: `[g, hd] · [hd, n]`, a softmax, `[g, n] · [n, hd]`.
// Through libtorch these are batched products of tiny matrices (MKL's `sgemm` spent a quarter of a
// SmolLM2 decoding step on them, most of it in overhead), and they must read every key position
// of the batch's longest slot, masked. Here each (slot, key head) pair is one task over exactly
// its own keys `first..=last`: the work is that of the keys in use, and a slot's result depends on
// nothing but its own query, keys and values (not on the other slots, the batch size or the
// cache's capacity), summed in a fixed order.
//
// Head sizes 64 and 128 (most Llama models) are written on 16-float vectors, which GCC and Clang on
// x86-64 Linux compile three times (AVX-512, AVX2 with FMA, the baseline) and pick from at load time
// for the CPU at hand: the bits are the same from run to run on one machine, not from one CPU kind
// to another. Other head sizes take plain loops. The softmax's exponential is a polynomial
// (Cephes' `expf`), so that it vectorises too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "c_boundary.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define TOPR_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define TOPR_CLONES
#endif

constexpr int64_t LANES = 16;

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

// One (slot, key head) task: `g` queries `q [g, hd]` (rows `hd` apart) over `n` keys and values
// whose rows are `ks` resp. `vs` apart; output `y [g, hd]`. `scores` holds `g · n` floats. Every
// query's scores, their softmax, then every query's output summed over the keys in order. Any head
// size; sums in plain order.
void attend_scalar(const float* q, const float* k, const float* v, int64_t ks, int64_t vs, int64_t g, int64_t n,
                   int64_t hd, float scale, float* scores, float* y) {
  for (int64_t i = 0; i < g; ++i) {
    const float* qi = q + i * hd;
    float* si = scores + i * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const float* kj = k + j * ks;
      float s = 0.0f;
      for (int64_t d = 0; d < hd; ++d) s += qi[d] * kj[d];
      si[j] = s * scale;
      m = si[j] > m ? si[j] : m;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      si[j] = exp_nonpositive(si[j] - m);
      total += si[j];
    }
    const float inv = 1.0f / total;
    float* yi = y + i * hd;
    for (int64_t d = 0; d < hd; ++d) yi[d] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float p = si[j] * inv;
      const float* vj = v + j * vs;
      for (int64_t d = 0; d < hd; ++d) yi[d] += p * vj[d];
    }
  }
}

// Head sizes 64 and 128: the same computation written on 16-float vectors (GCC's and Clang's
// vector extensions: one AVX-512 register, two AVX2 or four SSE registers), so that a query, an
// output row and the partial sums stay in registers. The order of every sum is fixed: a dot
// product adds its 16-entry blocks in turn and then the lanes in a fixed tree (`lane_sum`),
// a maximum or a total runs 16 lanes over the keys then combines them, an output entry adds the
// keys in order.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

__attribute__((always_inline)) inline v16 load(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

__attribute__((always_inline)) inline void store(float* p, v16 x) { std::memcpy(p, &x, sizeof x); }

__attribute__((always_inline)) inline v16 splat(float a) { return v16{} + a; }

// The lanes' sum: halves added, then quarters, then the last four in pairs.
__attribute__((always_inline)) inline float lane_sum(v16 x) {
  v8 lo, hi;
  std::memcpy(&lo, &x, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof lo, sizeof hi);
  const v8 h = lo + hi;
  v4 a, b;
  std::memcpy(&a, &h, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof a, sizeof b);
  const v4 c = a + b;
  return (c[0] + c[2]) + (c[1] + c[3]);
}

// `exp_nonpositive` on 16 lanes at once.
__attribute__((always_inline)) inline v16 exp_nonpositive(v16 x) {
  const v16 lowest = splat(-87.0f);
  const auto nan = x != x;
  const auto big = x < lowest;
  x = (big | nan) ? lowest : x;
  const v16 t = x * 1.44269504088896341f + 0.5f;
  v16 n = __builtin_convertvector(__builtin_convertvector(t, i16v), v16);  // toward zero
  n = t < n ? n - 1.0f : n;                                                 // floor
  const v16 e = exp_remainder(x, n);
  const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
  v16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return nan ? splat(std::numeric_limits<float>::quiet_NaN()) : big ? splat(0.0f) : e * two_n;
}

// The softmax of `s [n]` in place.
__attribute__((always_inline)) inline void softmax(float* s, int64_t n) {
  const int64_t whole = n / LANES * LANES;
  v16 mv = splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < whole; j += LANES) {
    const v16 x = load(s + j);
    mv = x > mv ? x : mv;
  }
  float m = mv[0];
  for (int u = 1; u < LANES; ++u) m = mv[u] > m ? mv[u] : m;
  for (int64_t j = whole; j < n; ++j) m = s[j] > m ? s[j] : m;
  v16 tv = splat(0.0f);
  for (int64_t j = 0; j < whole; j += LANES) {
    const v16 e = exp_nonpositive(load(s + j) - m);
    store(s + j, e);
    tv += e;
  }
  float total = lane_sum(tv);
  for (int64_t j = whole; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - m);
    total += s[j];
  }
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < whole; j += LANES) store(s + j, load(s + j) * inv);
  for (int64_t j = whole; j < n; ++j) s[j] *= inv;
}

// Keys and values are read in chunks of this many rows (16 KiB of f32 at head size 128), which
// stay in the L1 cache while every query of the group uses them: each row comes from memory once.
constexpr int64_t CHUNK = 32;

// `attend_scalar` for head size `HD` (64 or 128), on vectors.
template <int64_t HD>
TOPR_CLONES void attend_vectors(const float* q, const float* k, const float* v, int64_t ks, int64_t vs, int64_t g,
                                int64_t n, int64_t, float scale, float* scores, float* y) {
  constexpr int V = HD / LANES;
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    const int64_t j1 = std::min(n, j0 + CHUNK);
    for (int64_t i = 0; i < g; ++i) {
      v16 qi[V];
      for (int c = 0; c < V; ++c) qi[c] = load(q + i * HD + c * LANES);
      float* si = scores + i * n;
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = k + j * ks;
        v16 a = qi[0] * load(kj);
        for (int c = 1; c < V; ++c) a += qi[c] * load(kj + c * LANES);
        si[j] = lane_sum(a) * scale;
      }
    }
  }
  for (int64_t i = 0; i < g; ++i) softmax(scores + i * n, n);
  for (int64_t x = 0; x < g * HD; ++x) y[x] = 0.0f;
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    const int64_t j1 = std::min(n, j0 + CHUNK);
    for (int64_t i = 0; i < g; ++i) {
      const float* si = scores + i * n;
      v16 acc[V];
      for (int c = 0; c < V; ++c) acc[c] = load(y + i * HD + c * LANES);
      for (int64_t j = j0; j < j1; ++j) {
        const v16 p = splat(si[j]);
        const float* vj = v + j * vs;
        for (int c = 0; c < V; ++c) acc[c] += p * load(vj + c * LANES);
      }
      for (int c = 0; c < V; ++c) store(y + i * HD + c * LANES, acc[c]);
    }
  }
}

using Group = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                       float*, float*);

// The task's code for this head size: vectors for 64 and 128 (most Llama models), scalar else.
Group group_for(int64_t hd) {
  switch (hd) {
    case 64:
      return attend_vectors<64>;
    case 128:
      return attend_vectors<128>;
    default:
      return attend_scalar;
  }
}

// `q [S, nh, 1, hd]`, the caches `k`, `v [S, nkv, P, hd]` (last dimension contiguous), `first`,
// `last [S]` (int64): `[S, nh, 1, hd]`, slot `s` attending to its positions `first[s]..=last[s]`.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& first_in,
                            const at::Tensor& last_in) {
  TORCH_CHECK(q_in.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode attention runs on the CPU");
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "decode attention takes f32 queries, keys and values");
  TORCH_CHECK(q_in.dim() == 4 && q_in.size(2) == 1, "decode attention takes one query per slot, [S, nh, 1, hd]");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "keys and values must both be [S, nkv, P, hd]");
  const int64_t slots = q_in.size(0), nh = q_in.size(1), hd = q_in.size(3);
  const int64_t nkv = k.size(1), positions = k.size(2);
  TORCH_CHECK(k.size(0) == slots && k.size(3) == hd, "the caches' slots and head size must match the queries'");
  TORCH_CHECK(nkv > 0 && nh % nkv == 0, "query heads must be a multiple of key heads");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "the caches' head dimension must be contiguous");
  const at::Tensor first = first_in.to(at::kLong).contiguous(), last = last_in.to(at::kLong).contiguous();
  TORCH_CHECK(first.numel() == slots && last.numel() == slots, "first and last need one entry per slot");
  const int64_t* f = first.data_ptr<int64_t>();
  const int64_t* l = last.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(0 <= f[s] && f[s] <= l[s] && l[s] < positions, "slot ", s, " attends to positions ", f[s], "..=", l[s],
                " of a cache of ", positions);
    longest = std::max(longest, l[s] - f[s] + 1);
  }
  const at::Tensor q = q_in.contiguous();
  at::Tensor y = at::empty_like(q);
  const int64_t g = nh / nkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const Group attend = group_for(hd);
  at::parallel_for(0, slots * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(static_cast<size_t>(g * longest));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / nkv, h = task % nkv;
      const int64_t n = l[s] - f[s] + 1;
      const float* kq = kp + s * k.stride(0) + h * k.stride(1) + f[s] * k.stride(2);
      const float* vq = vp + s * v.stride(0) + h * v.stride(1) + f[s] * v.stride(2);
      const int64_t row = (s * nh + h * g) * hd;
      attend(qp + row, kq, vq, k.stride(2), v.stride(2), g, n, hd, scale, scores.data(), yp + row);
    }
  });
  return y;
}

} // namespace

extern "C" {

// See `decode_attention`. NULL with `err` set on failure (bad shapes, a range outside the cache).
at::Tensor* topr_decode_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* first,
                                  const at::Tensor* last, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] { out = new at::Tensor(decode_attention(*q, *k, *v, *first, *last)); });
  return out;
}

} // extern "C"
