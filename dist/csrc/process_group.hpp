// The process group the shims share: the rendezvous store, the Gloo backend (CPU tensors, and
// every collective when there is no NCCL backend) and, once `topr_pg_add_nccl` has made it,
// the NCCL backend (CUDA tensors).
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

struct topr_process_group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> backend;
  std::chrono::milliseconds timeout;
  c10::intrusive_ptr<c10d::Backend> nccl;
  int rank = 0;
  int world_size = 1;

  // The backend for a collective on `t`: NCCL for a CUDA tensor when it is there, else Gloo.
  c10d::Backend& for_tensor(const at::Tensor& t) {
    return (t.is_cuda() && nccl) ? *nccl : *backend;
  }
};
