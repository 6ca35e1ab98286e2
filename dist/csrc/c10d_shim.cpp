// A C interface to PyTorch's c10d process groups (the engine of torch.distributed and PyTorch
// DDP), for the Rust crate topr-dist. It creates a TCPStore rendezvous and a Gloo (CPU) process
// group from libtorch, and runs three collectives on tensors handed over by tch: all-reduce
// (sum), broadcast and barrier; CUDA tensors go through the group's NCCL backend when
// `nccl_shim.cpp` has added one. Every C++ exception becomes an error message for Rust; nothing
// throws across the C boundary.
//
// tch passes a tensor as `torch::Tensor*` (torch-sys's `tensor` type), the `at::Tensor*` these
// functions take.
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "c_boundary.hpp"
#include "process_group.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace {

using topr::guarded;

// Waits for `work`. A collective on the GPU (NCCL) is waited for on the device: the current
// stream waits for NCCL's, and the host goes on (ProcessGroupNCCL's watchdog enforces the
// group's time-out there). Given a time-out, NCCL's `wait` would instead spin the host until the
// collective ends: a device synchronisation per call. On the CPU (Gloo) the host waits, bounded
// by the time-out.
void wait(const c10::intrusive_ptr<c10d::Work>& work, std::chrono::milliseconds timeout, bool on_device = false) {
  if (on_device) {
    work->wait();
    return;
  }
  if (!work->wait(timeout)) {
    throw std::runtime_error("the collective did not complete within the time-out");
  }
}

} // namespace

extern "C" {

// Joins the group of `world_size` processes whose rank 0 serves the rendezvous store at
// host:port (rank 0 listens there, the others connect); NULL with `err` set on failure.
topr_process_group* topr_pg_new_gloo(
    const char* host,
    uint16_t port,
    int rank,
    int world_size,
    int64_t timeout_ms,
    char* err,
    size_t cap) {
  topr_process_group* out = nullptr;
  guarded(err, cap, [&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = rank == 0;
    opts.numWorkers = static_cast<size_t>(world_size);
    opts.waitWorkers = true;
    opts.timeout = timeout;
    auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    // Devices as torch.distributed makes them: GLOO_SOCKET_IFNAME if set, else this host's
    // address (falling back to loopback).
    auto options = c10d::ProcessGroupGloo::Options::create_default(timeout);
    c10::intrusive_ptr<c10d::Backend> backend =
        c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
    out = new topr_process_group{store, backend, timeout, {}, rank, world_size};
  });
  return out;
}

// Frees the group. Its NCCL backend, if any, is shut down first, as torch.distributed's
// `destroy_process_group` does: `shutdown` lets the collectives in flight finish and then
// destroys the communicators, where ProcessGroupNCCL's destructor alone warns that the group was
// not destroyed and aborts them. A failure there has nowhere to go (this is a destructor) and is
// dropped; the backend is freed either way.
void topr_pg_free(topr_process_group* pg) {
  if (pg != nullptr && pg->nccl) {
    try {
      pg->nccl->shutdown();
    } catch (...) {
    }
  }
  delete pg;
}

// Sums `tensor` (contiguous) over the group, in place: through NCCL for a CUDA tensor when the
// group has it, through Gloo otherwise (a CUDA tensor staged through the host).
int topr_pg_all_reduce_sum(topr_process_group* pg, at::Tensor* tensor, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = pg->timeout;
    c10d::Backend& b = pg->for_tensor(*tensor);
    wait(b.allreduce(tensors, opts), pg->timeout, &b != pg->backend.get());
  });
}

// Copies `tensor` of rank `root` into the same tensor of every other rank.
int topr_pg_broadcast(topr_process_group* pg, at::Tensor* tensor, int root, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    std::vector<at::Tensor> tensors{*tensor};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = pg->timeout;
    c10d::Backend& b = pg->for_tensor(*tensor);
    wait(b.broadcast(tensors, opts), pg->timeout, &b != pg->backend.get());
  });
}

// Returns once every rank has called it.
int topr_pg_barrier(topr_process_group* pg, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    c10d::BarrierOptions opts;
    opts.timeout = pg->timeout;
    wait(pg->backend->barrier(opts), pg->timeout);
  });
}

} // extern "C"
