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
// Vectorised by the compiler: the dot products over `hd` keep 16 partial sums (combined in a fixed
// tree), the value sums run along `hd`; head sizes 64 and 128 have unrolled code. GCC and Clang on x86-64 Linux compile three versions
// (AVX-512, AVX2 with FMA, the baseline) and pick one at load time for the CPU at hand, so the bits
// are the same from run to run on one machine, not from one CPU kind to another.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include "c_boundary.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// `q · k` over `hd` entries: 16 partial sums (one per lane), combined in a fixed tree. `HD` is
// the head size when known at compile time (a multiple of 16: the loops unroll, the sums stay
// in registers), 0 for any other, read from `hd`.
template <int64_t HD>
inline float dot(const float* q, const float* k, int64_t hd) {
  if constexpr (HD == 0) {
    if (hd % LANES != 0) {
      float s = 0.0f;
      for (int64_t d = 0; d < hd; ++d) {
        s += q[d] * k[d];
      }
      return s;
    }
  }
  const int64_t n = HD == 0 ? hd : HD;
  float acc[LANES] = {0};
  for (int64_t d = 0; d < n; d += LANES) {
    for (int64_t u = 0; u < LANES; ++u) {
      acc[u] += q[d + u] * k[d + u];
    }
  }
  for (int64_t u = 0; u < 8; ++u) acc[u] += acc[u + 8];
  for (int64_t u = 0; u < 4; ++u) acc[u] += acc[u + 4];
  for (int64_t u = 0; u < 2; ++u) acc[u] += acc[u + 2];
  return acc[0] + acc[1];
}

// One (slot, key head) task: `g` queries `q [g, hd]` (rows `hd` apart) over `n` keys and values
// whose rows are `ks` resp. `vs` apart; output `y [g, hd]`. `scores` holds `n` floats.
// Query by query: its scores, their softmax, then its output summed over the keys in order.
template <int64_t HD>
TOPR_CLONES void attend_group(const float* q, const float* k, const float* v, int64_t ks, int64_t vs, int64_t g,
                              int64_t n, int64_t hd_in, float scale, float* scores, float* y) {
  const int64_t hd = HD == 0 ? hd_in : HD;
  for (int64_t i = 0; i < g; ++i) {
    const float* qi = q + i * hd;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      const float s = dot<HD>(qi, k + j * ks, hd) * scale;
      scores[j] = s;
      m = s > m ? s : m;
    }
    float total = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      scores[j] = std::exp(scores[j] - m);
      total += scores[j];
    }
    const float inv = 1.0f / total;
    float* yi = y + i * hd;
    if constexpr (HD != 0) {
      float acc[HD] = {0};
      for (int64_t j = 0; j < n; ++j) {
        const float p = scores[j] * inv;
        const float* vj = v + j * vs;
        for (int64_t d = 0; d < HD; ++d) {
          acc[d] += p * vj[d];
        }
      }
      for (int64_t d = 0; d < HD; ++d) {
        yi[d] = acc[d];
      }
    } else {
      for (int64_t d = 0; d < hd; ++d) {
        yi[d] = 0.0f;
      }
      for (int64_t j = 0; j < n; ++j) {
        const float p = scores[j] * inv;
        const float* vj = v + j * vs;
        for (int64_t d = 0; d < hd; ++d) {
          yi[d] += p * vj[d];
        }
      }
    }
  }
}

using Group = void (*)(const float*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t, float,
                       float*, float*);

// The task's code for this head size: unrolled for 64 and 128 (most Llama models), generic else.
Group group_for(int64_t hd) {
  switch (hd) {
    case 64:
      return attend_group<64>;
    case 128:
      return attend_group<128>;
    default:
      return attend_group<0>;
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
    std::vector<float> scores(static_cast<size_t>(longest));
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
