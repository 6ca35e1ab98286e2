// NCCL, c10d's GPU engine, for the process group of `c10d_shim.cpp`: compiled by `build.rs` only
// when the libtorch is a CUDA build and `nccl.h` (the `nvidia-nccl` wheel that CUDA builds of torch
// depend on) and the CUDA runtime's headers are found. `ProcessGroupNCCL.hpp` declares its class
// only under `USE_C10D_NCCL`, which the build defines; its code is libtorch's (libtorch_cuda).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "c_boundary.hpp"
#include "process_group.hpp"

extern "C" {

// Adds an NCCL backend to `pg` (every rank must call it), over the group's store under the prefix
// "nccl/" as torch.distributed does for a second backend; its collectives are bounded by the
// group's time-out. NCCL's communicators are made on the first collective, on the device of its
// tensor.
int topr_pg_add_nccl(topr_process_group* pg, char* err, size_t cap) {
  return topr::guarded(err, cap, [&] {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = pg->timeout;
    auto store = c10::make_intrusive<c10d::PrefixStore>("nccl", pg->store);
    pg->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, pg->rank, pg->world_size, options);
  });
}

} // extern "C"
