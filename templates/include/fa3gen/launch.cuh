// Host-side helpers every kernel library's launcher shares: per-device one-time setup and cached
// device attributes (the launch path runs per call, so nothing here may query the driver twice).
#pragma once
#include <atomic>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>

namespace fa3gen {

constexpr int kMaxDevices = 64;

// Raises `kernel`'s dynamic shared-memory limit to `bytes`: a per-device attribute of the function,
// set once per device before any graph capture (the first call is an ordinary launch).
template <auto Kernel>
cudaError_t raise_smem_limit_once(int bytes) {
  static std::atomic<bool> configured[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) { return err; }
  if (device < kMaxDevices && configured[device].load()) { return cudaSuccess; }
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess && device < kMaxDevices) { configured[device].store(true); }
  return err;
}

// A device attribute of the current device, queried once per device and attribute.
template <cudaDeviceAttr kAttribute>
cudaError_t device_attribute(int* value) {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) { return err; }
  if (device < kMaxDevices && (*value = cached[device].load()) > 0) { return cudaSuccess; }
  err = cudaDeviceGetAttribute(value, kAttribute, device);
  if (err == cudaSuccess && device < kMaxDevices) { cached[device].store(*value); }
  return err;
}

// How many clusters of `config`'s shape (its cluster dimension, block and shared memory) the
// current device holds at once: a cluster's CTAs share a GPC, so a persistent cluster grid can be
// smaller than the SM count. Queried once per device, after the shared-memory limit is raised.
template <auto Kernel>
cudaError_t max_active_clusters_once(cudaLaunchConfig_t const& config, int* clusters) {
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) { return err; }
  if (device < kMaxDevices && (*clusters = cached[device].load()) > 0) { return cudaSuccess; }
  err = cudaOccupancyMaxActiveClusters(clusters, Kernel, &config);
  if (err == cudaSuccess && device < kMaxDevices) { cached[device].store(*clusters); }
  return err;
}

// A (seqlen, dim, heads, batch) view of a (batch, seqlen, heads, dim) tensor with run-time strides
// in elements and a contiguous last dim: what the TMA descriptors are built from.
template <class Pointer>
auto gmem_tensor(Pointer ptr, int seqlen, int dim, int heads, int batch, int64_t row_stride, int64_t head_stride,
                 int64_t batch_stride) {
  using namespace cute;
  return make_tensor(make_gmem_ptr(ptr), make_layout(make_shape(seqlen, dim, heads, batch),
                                                     make_stride(row_stride, _1{}, head_stride, batch_stride)));
}

}  // namespace fa3gen
