// The next token of every slot of a decoding step on the CPU, from its logits, in one kernel
// (`src/next_tokens.rs`): whether the row is finite, the token (the row's first maximum when
// greedy, else a draw by inversion of the sampling distribution), and its log-probabilities under
// the model and under the sampling distribution.
//
// Through libtorch that is a finite check, a log-softmax, an exponential, a cumulative sum in
// f64, a search and two gathers, each a pass over the `[S, V]` logits (49,152 entries a row for
// SmolLM2) and most of them a new `[S, V]` tensor. Here each row is read two or three times and
// nothing of its size is written: a pass for its maximum and finiteness, a pass for the sum of its
// exponentials (kept per block of 64 entries), then the draw walks the blocks' sums to the block
// where the cumulative sum passes `u` times the total, and that block's entries one by one.
//
// Every sum runs in a fixed order: a block's 64 exponentials as 16 lanes (`Lanes`, the same bits
// on every vector width with fused products), the blocks' sums and the walk in f64, in order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include "c_boundary.hpp"
#include "lanes.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using namespace topr::lanes;

constexpr int64_t BLOCK = 64;  // entries a block: four groups of 16 lanes

// The maximum of `x [v]` (NaN entries skipped) and whether every entry is finite.
template <int N>
__attribute__((always_inline)) inline void max_and_finite(const float* x, int64_t v, float* max, bool* finite) {
  typedef Lanes<N> L;
  const int64_t whole = v / LANES * LANES;
  L mv = L::splat(-std::numeric_limits<float>::infinity());
  L zero = L::splat(0.0f);  // x − x: 0 for a finite entry, NaN for ±∞ and NaN
  for (int64_t j = 0; j < whole; j += LANES) {
    const L x16 = L::load(x + j);
    for (int p = 0; p < L::P; ++p) {
      mv.x[p] = x16.x[p] > mv.x[p] ? x16.x[p] : mv.x[p];
      zero.x[p] += x16.x[p] - x16.x[p];
    }
  }
  float m = mv.max();
  float z = zero.sum();
  for (int64_t j = whole; j < v; ++j) {
    m = x[j] > m ? x[j] : m;
    z += x[j] - x[j];
  }
  *max = m;
  *finite = z == 0.0f;
}

// `e^(x − m)` of the 16 entries at `x`, added to `acc`.
template <int N>
__attribute__((always_inline)) inline void add_exps(const float* x, float m, Lanes<N>& acc) {
  const Lanes<N> x16 = Lanes<N>::load(x);
  for (int p = 0; p < Lanes<N>::P; ++p) acc.x[p] += exp_lanes<N>(x16.x[p] - m);
}

// Σ_j e^(x_j − m) over `x [v]`, by blocks of `BLOCK` entries (their sums in `blocks`, when given:
// `v / BLOCK` whole blocks, then the rest as one more) added in order in f64.
template <int N>
__attribute__((always_inline)) inline double exp_total(const float* x, int64_t v, float m, double* blocks) {
  double total = 0.0;
  const int64_t whole = v / BLOCK;
  for (int64_t b = 0; b < whole; ++b) {
    Lanes<N> acc = Lanes<N>::splat(0.0f);
    for (int64_t c = 0; c < BLOCK; c += LANES) add_exps<N>(x + b * BLOCK + c, m, acc);
    const float sum = acc.sum();
    if (blocks != nullptr) blocks[b] = sum;
    total += sum;
  }
  if (whole * BLOCK < v) {
    float sum = 0.0f;
    for (int64_t j = whole * BLOCK; j < v; ++j) sum += exp_nonpositive(x[j] - m);
    if (blocks != nullptr) blocks[whole] = sum;
    total += sum;
  }
  return total;
}

// The entries `e^(x_j − m)` of block `b` (`BLOCK` of them, fewer in a last, partial block), as
// `exp_total` computed them.
template <int N>
__attribute__((always_inline)) inline int64_t block_exps(const float* x, int64_t v, float m, int64_t b, float* out) {
  const int64_t start = b * BLOCK, n = std::min(BLOCK, v - start);
  if (n == BLOCK) {
    for (int64_t c = 0; c < BLOCK; c += LANES) {
      Lanes<N> e = Lanes<N>::load(x + start + c);
      for (int p = 0; p < Lanes<N>::P; ++p) e.x[p] = exp_lanes<N>(e.x[p] - m);
      e.store(out + c);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) out[j] = exp_nonpositive(x[start + j] - m);
  }
  return n;
}

// The first entry whose cumulative weight passes `target` (in `[0, total)`): the blocks' sums
// walked in order, then the block's entries. Where rounding leaves the walk short of the target
// (the entries of a block summed one by one against the block's sum), the last entry of positive
// weight before that point; 0 for a row of no weight.
template <int N>
__attribute__((always_inline)) inline int64_t invert(const float* x, int64_t v, float m, const double* blocks,
                                                     double target) {
  const int64_t count = (v + BLOCK - 1) / BLOCK;
  double cum = 0.0;
  int64_t b = 0;
  while (b < count && !(cum + blocks[b] > target)) cum += blocks[b++];
  int64_t last_positive = -1;
  float e[BLOCK];
  for (int64_t bb = std::min(b, count - 1); bb >= 0; --bb) {
    const int64_t n = block_exps<N>(x, v, m, bb, e);
    if (bb == b) {
      for (int64_t j = 0; j < n; ++j) {
        cum += e[j];
        if (e[j] > 0.0f) last_positive = bb * BLOCK + j;
        if (cum > target && e[j] > 0.0f) return bb * BLOCK + j;
      }
    } else {
      for (int64_t j = n - 1; j >= 0 && last_positive < 0; --j)
        if (e[j] > 0.0f) last_positive = bb * BLOCK + j;
    }
    if (last_positive >= 0) return last_positive;
  }
  return 0;
}

// One row: `logits [v]` (the model's), `z [v]` (the sampling distribution's logits, or `logits`
// itself), `u` in `[0, 1)` (negative: greedy). Writes the token, `log q(token)` (0 when greedy),
// `log π(token)` and whether the logits are finite.
template <int N>
__attribute__((always_inline)) inline void next_row(const float* logits, const float* z, int64_t v, double u,
                                                    double* blocks, int64_t* token, float* lq, float* lp,
                                                    bool* finite) {
  float m;
  max_and_finite<N>(logits, v, &m, finite);
  const bool sampled = u >= 0.0;
  const bool same = z == logits;
  const double total = exp_total<N>(logits, v, m, sampled && same ? blocks : nullptr);
  int64_t t = 0;
  if (!sampled) {
    while (t < v && !(logits[t] == m)) ++t;
    if (t == v) t = 0;  // no entry equals the maximum: a row of NaN (refused by the caller)
    *lq = 0.0f;
  } else {
    float mz = m;
    double tz = total;
    if (!same) {
      bool ignored;
      max_and_finite<N>(z, v, &mz, &ignored);
      tz = exp_total<N>(z, v, mz, blocks);
    }
    t = invert<N>(z, v, mz, blocks, u * tz);
    *lq = static_cast<float>(static_cast<double>(z[t] - mz) - std::log(tz));
  }
  *token = t;
  *lp = static_cast<float>(static_cast<double>(logits[t] - m) - std::log(total));
}

typedef void (*Row)(const float*, const float*, int64_t, double, double*, int64_t*, float*, float*, bool*);

#ifdef TOPR_X86_DISPATCH
__attribute__((target("avx512f"))) void row_avx512(const float* l, const float* z, int64_t v, double u, double* b,
                                                   int64_t* t, float* lq, float* lp, bool* f) {
  next_row<16>(l, z, v, u, b, t, lq, lp, f);
}
__attribute__((target("arch=x86-64-v3"))) void row_avx2(const float* l, const float* z, int64_t v, double u,
                                                        double* b, int64_t* t, float* lq, float* lp, bool* f) {
  next_row<8>(l, z, v, u, b, t, lq, lp, f);
}
#endif
void row_base(const float* l, const float* z, int64_t v, double u, double* b, int64_t* t, float* lq, float* lp,
              bool* f) {
  next_row<4>(l, z, v, u, b, t, lq, lp, f);
}

Row row_for(int width) {
  width = chosen_width(width);
  TORCH_CHECK(runs_width(width), "this CPU has no version on vectors of ", width, " floats");
#ifdef TOPR_X86_DISPATCH
  if (width == 16) return row_avx512;
  if (width == 8) return row_avx2;
#endif
  return row_base;
}

// `logits [S, V]` f32; `z` undefined (the logits themselves) or `[S, V]` f32; `u` undefined
// (greedy) or `[S]` f64 in `[0, 1)`. Returns the tokens `[S]` int64, `log q` and `log π` `[S]` f32,
// and the rows' finiteness `[S]` bool.
std::vector<at::Tensor> next_tokens(const at::Tensor& logits_in, const at::Tensor& z_in, const at::Tensor& u_in,
                                    int width) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kFloat && logits_in.dim() == 2,
              "the next tokens take f32 logits [S, V] on the CPU");
  const int64_t slots = logits_in.size(0), v = logits_in.size(1);
  TORCH_CHECK(v > 0, "the logits have no vocabulary");
  const at::Tensor logits = logits_in.contiguous();
  const bool own = !z_in.defined();
  if (!own)
    TORCH_CHECK(z_in.device().is_cpu() && z_in.scalar_type() == at::kFloat && z_in.sizes() == logits_in.sizes(),
                "the sampling logits must be f32 on the CPU, shaped as the logits");
  const at::Tensor z = own ? logits : z_in.contiguous();
  const bool sampled = u_in.defined();
  at::Tensor u;
  if (sampled) {
    TORCH_CHECK(u_in.device().is_cpu() && u_in.numel() == slots, "the uniform numbers need one entry per slot");
    u = u_in.to(at::kDouble).contiguous();
    const double* up = u.data_ptr<double>();
    for (int64_t s = 0; s < slots; ++s)
      TORCH_CHECK(up[s] >= 0.0 && up[s] < 1.0, "slot ", s, "'s uniform number ", up[s], " is outside [0, 1)");
  }
  const at::TensorOptions on = logits.options();
  at::Tensor token = at::empty({slots}, on.dtype(at::kLong)), lq = at::empty({slots}, on),
             lp = at::empty({slots}, on), finite = at::empty({slots}, on.dtype(at::kBool));
  const Row row = row_for(width);
  const float* lgp = logits.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const double* up = sampled ? u.data_ptr<double>() : nullptr;
  int64_t* tp = token.data_ptr<int64_t>();
  float* lqp = lq.data_ptr<float>();
  float* lpp = lp.data_ptr<float>();
  bool* fp = finite.data_ptr<bool>();
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> blocks(static_cast<size_t>((v + BLOCK - 1) / BLOCK));
    for (int64_t s = begin; s < end; ++s) {
      const float* l = lgp + s * v;
      row(l, own ? l : zp + s * v, v, sampled ? up[s] : -1.0, blocks.data(), tp + s, lqp + s, lpp + s, fp + s);
    }
  });
  return {token, lq, lp, finite};
}

}  // namespace

extern "C" {

// See `next_tokens` (`z`, `u`: NULL for the logits themselves, for greedy; `width`: 0 for the
// widest vectors this CPU has, else 4, 8 or 16). Writes four new tensors to `out`; false with
// `err` set on failure.
bool topr_next_tokens(const at::Tensor* logits, const at::Tensor* z, const at::Tensor* u, int width, at::Tensor** out,
                      char* err, size_t cap) {
  bool ok = false;
  topr::guarded(err, cap, [&] {
    RECORD_FUNCTION("topr::next_tokens", std::vector<c10::IValue>());  // named in a profile
    std::vector<at::Tensor> r = next_tokens(*logits, z ? *z : at::Tensor(), u ? *u : at::Tensor(), width);
    for (size_t i = 0; i < r.size(); ++i) out[i] = new at::Tensor(std::move(r[i]));
    ok = true;
  });
  return ok;
}

}  // extern "C"
