// The TMA descriptor encoder, looked up in the driver once per process.
//
// CuTe's make_tma_copy encodes each descriptor with cuTensorMapEncodeTiled. By default CUTLASS
// looks that function up in the driver (cudaGetDriverEntryPointByVersion) on every call: several
// descriptors per launch, every launch. With CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL it calls the
// function by name instead, and this header defines that name as a forwarder to the driver's entry
// point, found once. The library still does not link libcuda (it loads on a machine without a
// driver), and the definition is hidden, so it binds only this library's calls.
// Include before any CUTLASS or CuTe header.
#pragma once
#define CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
#include <atomic>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

extern "C" __attribute__((visibility("hidden"))) CUresult CUDAAPI cuTensorMapEncodeTiled(
    CUtensorMap* tensor_map, CUtensorMapDataType data_type, cuuint32_t rank, void* global_address,
    cuuint64_t const* global_dim, cuuint64_t const* global_strides, cuuint32_t const* box_dim,
    cuuint32_t const* element_strides, CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
    CUtensorMapL2promotion l2_promotion, CUtensorMapFloatOOBfill oob_fill) {
  static std::atomic<PFN_cuTensorMapEncodeTiled_v12000> driver_encode{nullptr};
  PFN_cuTensorMapEncodeTiled_v12000 encode = driver_encode.load(std::memory_order_acquire);
  if (encode == nullptr) {  // first call (or an earlier lookup failed: ask again)
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &entry, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess || entry == nullptr) {
      return CUDA_ERROR_NOT_FOUND;
    }
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(entry);
    driver_encode.store(encode, std::memory_order_release);
  }
  return encode(tensor_map, data_type, rank, global_address, global_dim, global_strides, box_dim, element_strides,
                interleave, swizzle, l2_promotion, oob_fill);
}
