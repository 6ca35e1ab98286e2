// Declarations only: see ../README.md. ProcessGroupGloo.hpp holds gloo::Context behind
// std::shared_ptr and calls setTimeout in an inline member the shim never calls.
#pragma once
#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
} // namespace gloo
