// CUDA graphs for the fixed-shape decoding step (src/cuda_graph.rs): libtorch's
// `at::cuda::CUDAGraph` (ATen/cuda/CUDAGraph.h), which tch does not wrap, behind a C boundary.
//
// A capture runs on a side stream (CUDA cannot capture the legacy default stream): `begin` makes
// a stream from libtorch's pool current and starts capturing (Rust has synchronised the device); every
// libtorch operation Rust then issues on that device is recorded, not run; `end` finishes the
// capture and makes the previous stream current again. `replay` launches the whole recorded step
// on the current stream with one call. The decoding step draws its random numbers from integer
// hashes of tensors it holds (src/generate.rs), not from a CUDA generator, so no generator state
// needs registering with the graph.
#include "c_boundary.hpp"

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <optional>

namespace {

// The guards of c10 (CUDAGuard, CUDAStreamGuard) are inline and would call the CUDA runtime from
// this file, which would then need libcudart at link time; the functions used here are c10's
// exported ones, and the device is synchronised from Rust before a capture begins.
struct Graph {
  at::cuda::CUDAGraph graph;
  std::optional<c10::cuda::CUDAStream> previous;
};

} // namespace

extern "C" {

// A new, empty graph; null (with the message in `err`) on failure.
void* topr_cuda_graph_new(char* err, size_t cap) {
  Graph* out = nullptr;
  topr::guarded(err, cap, [&] { out = new Graph(); });
  return out;
}

// Starts capturing on a side stream of device `device` (whose earlier work has finished).
int topr_cuda_graph_begin(void* g, int device, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    auto* graph = static_cast<Graph*>(g);
    auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::set_device(index);
    graph->previous = c10::cuda::getCurrentCUDAStream(index);
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(false, index));
    try {
      graph->graph.capture_begin();
    } catch (...) {
      c10::cuda::setCurrentCUDAStream(*graph->previous);
      throw;
    }
  });
}

// Ends the capture and restores the stream that was current before it.
int topr_cuda_graph_end(void* g, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    auto* graph = static_cast<Graph*>(g);
    auto restore = [&] {
      if (graph->previous) {
        c10::cuda::setCurrentCUDAStream(*graph->previous);
      }
    };
    try {
      graph->graph.capture_end();
    } catch (...) {
      restore();
      throw;
    }
    restore();
  });
}

// Launches the captured work on the current stream.
int topr_cuda_graph_replay(void* g, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] { static_cast<Graph*>(g)->graph.replay(); });
}

void topr_cuda_graph_free(void* g) {
  delete static_cast<Graph*>(g);
}

} // extern "C"
