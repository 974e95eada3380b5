// Device helpers of the attention variants: fast tanh for soft-capping, and the strided view a
// score_mod / mask_mod expression indexes its tensor parameters with.
#pragma once
#include <cstdint>
#include <type_traits>

namespace fa3gen {

// tanh on the special-function unit (one MUFU.TANH; max relative error about 2^-11), as soft-capping
// needs it once per score.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// A read-only N-d tensor with element strides: t(i0, ..., iN-1). Floating-point elements are read
// as float, integers and bools as themselves.
template <class T, int N>
struct TensorArg {
  T const* data;
  int64_t const* stride;

  using Value = std::conditional_t<std::is_integral_v<T>, T, float>;

  template <class... Index>
  __device__ __forceinline__ Value operator()(Index... index) const {
    static_assert(sizeof...(Index) == N, "a tensor parameter takes exactly ndim indices");
    int64_t const idx[N] = {int64_t(index)...};
    int64_t offset = 0;
#pragma unroll
    for (int d = 0; d < N; ++d) { offset += idx[d] * stride[d]; }
    return Value(data[offset]);
  }
};

}  // namespace fa3gen
