// CUDA graphs for the fixed-shape decoding step (src/cuda_graph.rs): libtorch's
// `at::cuda::CUDAGraph` (ATen/cuda/CUDAGraph.h), which tch does not wrap, behind a C boundary.
//
// A capture runs on a side stream (CUDA cannot capture the legacy default stream): `begin` makes
// the device's capture stream (one a device, taken once from libtorch's pool, as
// `torch.cuda.graph` keeps one default capture stream) current and starts capturing (Rust has
// synchronised the device); every libtorch operation Rust then issues on that device is
// recorded, not run; `end` finishes the
// capture and makes the previous stream current again. `replay` launches the whole recorded step
// on the current stream with one call. The decoding step draws its random numbers from integer
// hashes of tensors it holds (src/generate.rs), not from a CUDA generator, so no generator state
// needs registering with the graph.
//
// Memory: the tensors a recorded step allocates come from a pool of the graph's own. Graphs made
// with the same pool id (`topr_cuda_graph_pool`) share one: the decoding step's graphs of one
// batch size (one per key count) allocate nothing that outlives a step and never replay at the
// same time, so sharing is safe and their memory is one step's, not one step's per graph. Before
// each capture the allocator's unused cached memory is released (as PyTorch's `torch.cuda.graph`
// does): a pool of dropped graphs is otherwise freed only when an allocation outside a capture
// runs out of memory, and one inside a capture would fail instead.
#include "c_boundary.hpp"

#include <ATen/cuda/CUDAGraph.h>
#include <ATen/record_function.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>

namespace {

// The guards of c10 (CUDAGuard, CUDAStreamGuard) are inline and would call the CUDA runtime from
// this file, which would then need libcudart at link time; the functions used here are c10's
// exported ones, and the device is synchronised from Rust before a capture begins.
struct Graph {
  at::cuda::CUDAGraph graph;
  std::optional<c10::cuda::CUDAStream> previous;
};

// The capture stream of device `index`: the same stream for every capture, as PyTorch's
// `torch.cuda.graph` does. cuBLAS keeps a workspace per (handle, stream), made on the stream's
// first product, so a new pool stream for each recording (the pool hands its 32 out in turn)
// would allocate a workspace inside each of the first 32 captures and keep it for good. Two
// captures on one device at once would share the stream and the second would fail; none happen
// (the decoding step records one graph at a time, and a global-mode capture forbids it anyway).
c10::cuda::CUDAStream capture_stream(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::map<c10::DeviceIndex, c10::cuda::CUDAStream> streams;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = streams.find(index);
  if (it == streams.end()) {
    it = streams.emplace(index, c10::cuda::getStreamFromPool(false, index)).first;
  }
  return it->second;
}

} // namespace

extern "C" {

// A new, empty graph; null (with the message in `err`) on failure.
void* topr_cuda_graph_new(char* err, size_t cap) {
  Graph* out = nullptr;
  topr::guarded(err, cap, [&] { out = new Graph(); });
  return out;
}

// A new pool id for graphs that share their memory: its two halves.
int topr_cuda_graph_pool(unsigned long long* first, unsigned long long* second, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    const auto id = at::cuda::graph_pool_handle();
    *first = id.first;
    *second = id.second;
  });
}

// Starts capturing on a side stream of device `device` (whose earlier work has finished), into
// the pool `(pool_first, pool_second)` (from `topr_cuda_graph_pool`; `(0, 0)`: a pool of its own).
int topr_cuda_graph_begin(void* g, int device, unsigned long long pool_first, unsigned long long pool_second,
                          char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    auto* graph = static_cast<Graph*>(g);
    auto index = static_cast<c10::DeviceIndex>(device);
    c10::cuda::set_device(index);
    c10::cuda::CUDACachingAllocator::emptyCache();
    graph->previous = c10::cuda::getCurrentCUDAStream(index);
    c10::cuda::setCurrentCUDAStream(capture_stream(index));
    try {
      graph->graph.capture_begin({pool_first, pool_second});
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
  return topr::guarded(err, cap, [&] {
    RECORD_FUNCTION("topr::cuda_graph_replay", std::vector<c10::IValue>());  // named in a profile
    static_cast<Graph*>(g)->graph.replay();
  });
}

void topr_cuda_graph_free(void* g) {
  delete static_cast<Graph*>(g);
}

} // extern "C"
