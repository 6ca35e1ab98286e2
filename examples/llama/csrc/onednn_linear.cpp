// A C interface to oneDNN's linear layer as libtorch registers it (`mkldnn::_reorder_linear_weight`
// and `mkldnn::_linear_pointwise`, the kernels torch.compile's CPU inference path calls), for the
// Llama example's generation on the CPU. tch does not wrap these two operators (they live in the
// `mkldnn` namespace, not in ATen's native functions), so this file reaches them through the
// dispatcher, boxed, which does not depend on the C++ signature of the kernel.
//
// tch passes a tensor as `at::Tensor*`; a tensor returned to Rust is a new `at::Tensor*` that tch
// frees. Every C++ exception becomes an error message for Rust; nothing throws across the C
// boundary (`c_boundary.hpp`, topr-dist's).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include "c_boundary.hpp"

#include <cstdint>
#include <string>

namespace {

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

} // namespace

extern "C" {

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
  topr::guarded(err, cap, [&] {
    static const c10::OperatorHandle reorder = op("mkldnn::_reorder_linear_weight");
    torch::jit::Stack stack;
    stack.emplace_back(weight->contiguous());
    stack.emplace_back(c10::IValue());
    reorder.callBoxed(&stack);
    out = new at::Tensor(stack.at(0).toTensor());
  });
  return out;
}

// `x [M, K] · Wᵀ` for a weight packed by `topr_onednn_pack`: `[M, N]`, no bias.
at::Tensor* topr_onednn_linear(const at::Tensor* x, const at::Tensor* packed, char* err, size_t cap) {
  at::Tensor* out = nullptr;
  topr::guarded(err, cap, [&] {
    static const c10::OperatorHandle linear = op("mkldnn::_linear_pointwise");
    torch::jit::Stack stack;
    stack.emplace_back(x->contiguous());
    stack.emplace_back(*packed);
    stack.emplace_back(c10::IValue());
    stack.emplace_back(std::string("none"));
    stack.emplace_back(c10::List<std::optional<at::Scalar>>());
    stack.emplace_back(c10::IValue());
    linear.callBoxed(&stack);
    out = new at::Tensor(stack.at(0).toTensor());
  });
  return out;
}

// The version counter of `t` (bumped by every in-place change: an optimiser step, a copy into
// it), and its data pointer: together they tell whether a packed copy is still current.
int64_t topr_tensor_version(const at::Tensor* t, uintptr_t* data) {
  *data = reinterpret_cast<uintptr_t>(t->data_ptr());
  return static_cast<int64_t>(t->_version());
}

} // extern "C"
