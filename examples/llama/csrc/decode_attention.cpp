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
// Head sizes 64 and 128 (most Llama models) are written on groups of 16 float lanes, held in the
// CPU's own vectors: one AVX-512 register, two AVX2 ones or four SSE ones, a version for each
// compiled here and the widest the CPU at hand has picked at run time. Every version computes the
// same sums in the same order (the 16 lanes' arithmetic does not depend on how they are held), so
// the bits are the same from run to run on one machine; from one CPU kind to another they may
// differ where the compiler fuses a product and a sum (FMA, not in the SSE baseline). Other head
// sizes take plain loops. The softmax's exponential is a polynomial (Cephes' `expf`), so that it
// vectorises too.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include "c_boundary.hpp"
#include "lanes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace topr::lanes;


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

// Head sizes 64 and 128: the same computation on groups of 16 lanes, each held as `16 / N` native
// vectors of `N` floats (GCC's and Clang's vector extensions), so that a query, an output row and
// the partial sums stay in registers. (A 16-float vector type on a CPU with narrower registers
// compiles to stores and reloads through the stack, which cost two thirds of the kernel's time on
// AVX2.) The order of every sum is fixed by the 16 lanes: a dot product adds its 16-entry blocks
// in turn and then the lanes in a fixed tree (`Lanes::sum`), a maximum or a total runs 16 lanes
// over the keys then combines them, an output entry adds the keys in order.

// The softmax of `s [n]` in place.
template <int N>
__attribute__((always_inline)) inline void softmax(float* s, int64_t n) {
  typedef Lanes<N> L;
  const int64_t whole = n / LANES * LANES;
  L mv = L::splat(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < whole; j += LANES) {
    const L x = L::load(s + j);
    for (int p = 0; p < L::P; ++p) mv.x[p] = x.x[p] > mv.x[p] ? x.x[p] : mv.x[p];
  }
  float m = mv.max();
  for (int64_t j = whole; j < n; ++j) m = s[j] > m ? s[j] : m;
  L tv = L::splat(0.0f);
  for (int64_t j = 0; j < whole; j += LANES) {
    L e = L::load(s + j);
    for (int p = 0; p < L::P; ++p) {
      e.x[p] = exp_lanes<N>(e.x[p] - m);
      tv.x[p] += e.x[p];
    }
    e.store(s + j);
  }
  float total = tv.sum();
  for (int64_t j = whole; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - m);
    total += s[j];
  }
  const float inv = 1.0f / total;
  for (int64_t j = 0; j < whole; j += LANES) {
    L e = L::load(s + j);
    for (int p = 0; p < L::P; ++p) e.x[p] *= inv;
    e.store(s + j);
  }
  for (int64_t j = whole; j < n; ++j) s[j] *= inv;
}

// Keys and values are read in chunks of this many rows (16 KiB of f32 at head size 128), which
// stay in the L1 cache while every query of the group uses them: each row comes from memory once.
constexpr int64_t CHUNK = 32;

// `attend_scalar` for head size `HD` (64 or 128) on native vectors of `N` floats.
template <int64_t HD, int N>
__attribute__((always_inline)) inline void attend_lanes(const float* q, const float* k, const float* v, int64_t ks,
                                                        int64_t vs, int64_t g, int64_t n, float scale, float* scores,
                                                        float* y) {
  typedef typename Native<N>::f F;
  typedef Lanes<N> L;
  constexpr int V = HD / N;  // native vectors in a row
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    const int64_t j1 = std::min(n, j0 + CHUNK);
    for (int64_t i = 0; i < g; ++i) {
      F qi[V];
      for (int c = 0; c < V; ++c) qi[c] = load_as<F>(q + i * HD + c * N);
      float* si = scores + i * n;
      for (int64_t j = j0; j < j1; ++j) {
        const float* kj = k + j * ks;
        L a;
        for (int p = 0; p < L::P; ++p) a.x[p] = qi[p] * load_as<F>(kj + p * N);
        for (int c = L::P; c < V; ++c) a.x[c % L::P] += qi[c] * load_as<F>(kj + c * N);
        si[j] = a.sum() * scale;
      }
    }
  }
  for (int64_t i = 0; i < g; ++i) softmax<N>(scores + i * n, n);
  for (int64_t x = 0; x < g * HD; ++x) y[x] = 0.0f;
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK) {
    const int64_t j1 = std::min(n, j0 + CHUNK);
    for (int64_t i = 0; i < g; ++i) {
      const float* si = scores + i * n;
      F acc[V];
      for (int c = 0; c < V; ++c) acc[c] = load_as<F>(y + i * HD + c * N);
      for (int64_t j = j0; j < j1; ++j) {
        const F p = F{} + si[j];
        const float* vj = v + j * vs;
        for (int c = 0; c < V; ++c) acc[c] += p * load_as<F>(vj + c * N);
      }
      for (int c = 0; c < V; ++c) store_as(y + i * HD + c * N, acc[c]);
    }
  }
}

// One version a vector width, each compiled for the instructions it needs.
#ifdef TOPR_X86_DISPATCH
template <int64_t HD>
__attribute__((target("avx512f"))) void attend_avx512(const float* q, const float* k, const float* v, int64_t ks,
                                                      int64_t vs, int64_t g, int64_t n, int64_t, float scale,
                                                      float* scores, float* y) {
  attend_lanes<HD, 16>(q, k, v, ks, vs, g, n, scale, scores, y);
}

template <int64_t HD>
__attribute__((target("arch=x86-64-v3"))) void attend_avx2(const float* q, const float* k, const float* v, int64_t ks,
                                                           int64_t vs, int64_t g, int64_t n, int64_t, float scale,
                                                           float* scores, float* y) {
  attend_lanes<HD, 8>(q, k, v, ks, vs, g, n, scale, scores, y);
}
#endif

template <int64_t HD>
void attend_base(const float* q, const float* k, const float* v, int64_t ks, int64_t vs, int64_t g, int64_t n, int64_t,
                 float scale, float* scores, float* y) {
  attend_lanes<HD, 4>(q, k, v, ks, vs, g, n, scale, scores, y);
}

using Group = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                       float*, float*);

template <int64_t HD>
Group lanes_of(int width) {
#ifdef TOPR_X86_DISPATCH
  if (width == 16) return attend_avx512<HD>;
  if (width == 8) return attend_avx2<HD>;
#endif
  return attend_base<HD>;
}

// The task's code for this head size: lanes for 64 and 128 (most Llama models) on native vectors
// of `width` floats (0: the widest this CPU has), scalar loops for other head sizes (or with
// `width` −1, for tests).
Group group_for(int64_t hd, int width) {
  width = chosen_width(width);
  TORCH_CHECK(width == -1 || runs_width(width), "this CPU has no version on vectors of ", width, " floats");
  if (width == -1) return attend_scalar;
  switch (hd) {
    case 64:
      return lanes_of<64>(width);
    case 128:
      return lanes_of<128>(width);
    default:
      return attend_scalar;
  }
}

// `q [S, nh, 1, hd]`, the caches `k`, `v [S, nkv, P, hd]` (last dimension contiguous), `first`,
// `last [S]` (int64): `[S, nh, 1, hd]`, slot `s` attending to its positions `first[s]..=last[s]`.
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k, const at::Tensor& v, const at::Tensor& first_in,
                            const at::Tensor& last_in, int width) {
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
  const Group attend = group_for(hd, width);
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

// See `decode_attention` (`width`: see `group_for`). NULL with `err` set on failure (bad shapes,
// a range outside the cache, a width this CPU lacks).
at::Tensor* topr_decode_attention(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, const at::Tensor* first,
                                  const at::Tensor* last, int width, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] {
    RECORD_FUNCTION("topr::decode_attention", std::vector<c10::IValue>());  // named in a profile
    out = new at::Tensor(decode_attention(*q, *k, *v, *first, *last, width));
  });
  return out;
}

// Whether this CPU runs the version on native vectors of `width` floats (for tests).
bool topr_decode_attention_runs_width(int width) { return runs_width(width); }

} // extern "C"
