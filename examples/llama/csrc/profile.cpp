// libtorch's profiler (Kineto, the one behind `torch.profiler`), which tch does not wrap, behind
// a C boundary (src/profile.rs): `start` enables it for this process's libtorch operations on
// the CPU and, with `cuda`, for the CUDA runtime calls and the kernels (CUPTI) of every device;
// `stop` disables it and writes what it recorded as a Chrome trace (JSON), as
// `torch.profiler.profile().export_chrome_trace` does.
#include "c_boundary.hpp"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <set>
#include <string>

namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

} // namespace

extern "C" {

// Starts the profiler: CPU operators, and with `cuda` CUDA activity too.
int topr_profile_start(int cuda, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    ProfilerConfig config(ProfilerState::KINETO);
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(ActivityType::CUDA);
    }
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  });
}

// Stops the profiler and writes its trace to `path` (nothing written when `path` is null).
int topr_profile_stop(const char* path, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    auto result = prof::disableProfiler();
    if (path != nullptr && result) {
      result->save(std::string(path));
    }
  });
}

} // extern "C"
