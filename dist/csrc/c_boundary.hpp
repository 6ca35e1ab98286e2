// What every C++ shim of this project does at its C boundary: run a body, catch every C++
// exception and hand its message (without libtorch's C++ backtrace) to Rust in a buffer, so that
// nothing throws across `extern "C"`. Shared by `c10d_shim.cpp` and the Llama example's
// `onednn_linear.cpp` (whose build finds this folder through the `DEP_TOPR_C10D_INCLUDE` variable
// that topr-dist's build script exports).
#pragma once

#include <c10/util/Exception.h>

#include <cstddef>
#include <cstring>
#include <exception>

namespace topr {

// `msg` into `err` (at most `cap` bytes, NUL-terminated).
inline void set_error(char* err, size_t cap, const char* msg) {
  if (err == nullptr || cap == 0) {
    return;
  }
  std::strncpy(err, msg, cap - 1);
  err[cap - 1] = '\0';
}

// Runs `f`: 0 if it returned, 1 with the exception's message in `err` if it threw.
template <typename F>
int guarded(char* err, size_t cap, F&& f) {
  try {
    f();
    return 0;
  } catch (const c10::Error& e) {
    set_error(err, cap, e.what_without_backtrace());
  } catch (const std::exception& e) {
    set_error(err, cap, e.what());
  } catch (...) {
    set_error(err, cap, "unknown C++ exception");
  }
  return 1;
}

} // namespace topr
