// A C interface to oneDNN's linear layer as libtorch registers it (`mkldnn::_reorder_linear_weight`
// and `mkldnn::_linear_pointwise`, the kernels torch.compile's CPU inference path calls), for the
// Llama example's generation on the CPU, and a differentiable linear layer on them for its training
// (`TrainLinear`, a libtorch autograd function). tch does not wrap these two operators (they live
// in the `mkldnn` namespace, not in ATen's native functions), so this file reaches them through
// the dispatcher, boxed, which does not depend on the C++ signature of the kernel.
//
// tch passes a tensor as `at::Tensor*`; a tensor returned to Rust is a new `at::Tensor*` that tch
// frees. Every C++ exception becomes an error message for Rust; nothing throws across the C
// boundary (`c_boundary.hpp`, topr-dist's).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include "c_boundary.hpp"

#include <cstdint>
#include <string>

namespace {

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor pack(const at::Tensor& weight) {
  static const c10::OperatorHandle reorder = op("mkldnn::_reorder_linear_weight");
  torch::jit::Stack stack;
  stack.emplace_back(weight.contiguous());
  stack.emplace_back(c10::IValue());
  reorder.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// `x [M, K] · Wᵀ` for a packed `W [N, K]`: `[M, N]`.
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle linear = op("mkldnn::_linear_pointwise");
  torch::jit::Stack stack;
  stack.emplace_back(x.contiguous());
  stack.emplace_back(packed);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  linear.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// `y = x · Wᵀ` for training: the forward and the input's gradient `∂x = ∂y · W` by oneDNN (the
// weight, resp. its transpose, packed on each call, since training changes it every step), the
// weight's gradient `∂W = ∂yᵀ · x` by libtorch's `mm` (MKL), which is faster than oneDNN for
// that product at the example's shapes (docs/performance.md). Not twice differentiable.
struct TrainLinear : public torch::autograd::Function<TrainLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return packed_linear(x.reshape({-1, x.size(-1)}), pack(w)).view(sizes);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    auto g = grads[0].reshape({-1, grads[0].size(-1)}).contiguous();
    at::Tensor gx, gw;
    if (ctx->needs_input_grad(0)) {
      gx = packed_linear(g, pack(w.t().contiguous())).view(x.sizes());
    }
    if (ctx->needs_input_grad(1)) {
      gw = at::mm(g.t(), x.reshape({-1, x.size(-1)}));
    }
    return {gx, gw};
  }
};

} // namespace

extern "C" {

// `x [.., K] · Wᵀ` for `W [N, K]`, differentiable in both (see `TrainLinear`): `[.., N]`.
at::Tensor* topr_onednn_train_linear(const at::Tensor* x, const at::Tensor* w, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] { out = new at::Tensor(TrainLinear::apply(*x, *w)); });
  return out;
}

// 1 when this libtorch registers both operators (a build with oneDNN on x86 or ARM), else 0.
int topr_onednn_available() {
  try {
    auto& d = c10::Dispatcher::singleton();
    return d.findSchema({"mkldnn::_reorder_linear_weight", ""}).has_value() &&
           d.findSchema({"mkldnn::_linear_pointwise", ""}).has_value();
  } catch (...) {
    return 0;
  }
}

// `weight [N, K]` (f32 or bf16, CPU) in oneDNN's blocked layout (no batch-size hint). NULL with
// `err` set on failure.
at::Tensor* topr_onednn_pack(const at::Tensor* weight, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] { out = new at::Tensor(pack(*weight)); });
  return out;
}

// `x [M, K] · Wᵀ` for a weight packed by `topr_onednn_pack`: `[M, N]`, no bias.
at::Tensor* topr_onednn_linear(const at::Tensor* x, const at::Tensor* packed, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] { out = new at::Tensor(packed_linear(*x, *packed)); });
  return out;
}

// The version counter of `t` (bumped by every in-place change: an optimiser step, a copy into
// it), and its data pointer: together they tell whether a packed copy is still current.
int64_t topr_tensor_version(const at::Tensor* t, uintptr_t* data) {
  *data = reinterpret_cast<uintptr_t>(t->data_ptr());
  return static_cast<int64_t>(t->_version());
}

} // extern "C"
