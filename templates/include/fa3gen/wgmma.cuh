// Warpgroup MMA helpers shared by every generated kernel: issuing a WGMMA GEMM over a tile, and
// re-viewing accumulator fragments as rows/columns or as the A operand of the next GEMM.
#pragma once
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

namespace fa3gen {

using namespace cute;

// C (+)= A·B over the whole K extent of the fragments, as one committed WGMMA batch.
// The caller decides when to wait (warpgroup_wait<N>), so GEMMs can be kept in flight.
template <bool kZeroInit, class TiledMma, class TensorA, class TensorB, class TensorC>
__device__ __forceinline__ void wgmma_gemm(TiledMma& mma, TensorA const& tA, TensorB const& tB, TensorC& tC) {
  // A from registers (P·V) needs its registers fenced too; A from shared memory is a descriptor.
  constexpr bool kARegisters = !cute::is_same_v<typename TensorA::iterator, GMMA::DescriptorIterator>;
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<TensorA&>(tA)); }
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  mma.accumulate_ = kZeroInit ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tC);
  if constexpr (kARegisters) { warpgroup_fence_operand(const_cast<TensorA&>(tA)); }
}

// A WGMMA accumulator fragment is ((2, 2, N/8), MMA_M, MMA_N): per thread, column pairs, two rows
// eight apart, and N/8 column groups. Softmax wants it as (rows, columns): ((2, MMA_M), (2, N/8, MMA_N)).
template <class Layout>
__device__ __forceinline__ constexpr auto accumulator_as_rows_cols(Layout acc) {
  auto v = get<0>(acc);
  return make_layout(make_layout(get<1>(v), get<1>(acc)),
                     make_layout(get<0>(v), get<2>(v), get<2>(acc)));
}

// The same registers as the A operand of a register-sourced WGMMA with K = 16 per instruction:
// ((2, 2, 2), MMA_M, K/16). Pairs of 8-column groups of the accumulator form one 16-wide K slice.
template <class Layout>
__device__ __forceinline__ constexpr auto accumulator_as_a_operand(Layout acc) {
  static_assert(decltype(size<0, 2>(acc))::value % 2 == 0, "accumulator N must be a multiple of 16");
  auto v = logical_divide(get<0>(acc), Shape<Underscore, Underscore, _2>{});  // (2, 2, (2, N/16))
  return make_layout(make_layout(get<0>(v), get<1>(v), get<2, 0>(v)), get<1>(acc),
                     coalesce(make_layout(get<2, 1>(v), get<2>(acc))));
}

// Rounds an fp32 fragment into a same-shaped fragment of To, two elements per conversion.
template <class To, class TensorFrom, class TensorTo>
__device__ __forceinline__ void convert_fragment(TensorFrom const& from, TensorTo& to) {
  static_assert(decltype(size(from))::value % 2 == 0);
  using From = typename TensorFrom::value_type;
  cutlass::NumericArrayConverter<To, From, 2> convert;
  auto const* src = reinterpret_cast<cutlass::Array<From, 2> const*>(raw_pointer_cast(from.data()));
  auto* dst = reinterpret_cast<cutlass::Array<To, 2>*>(raw_pointer_cast(to.data()));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < decltype(size(from))::value / 2; ++i) { dst[i] = convert(src[i]); }
}

}  // namespace fa3gen
