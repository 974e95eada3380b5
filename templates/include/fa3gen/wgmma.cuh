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

// O += P·V and, in the same committed batch, sums = P·1: an N = 8 WGMMA per K slice over a
// shared-memory tile of ones, beside V's (row sums on the tensor cores). Every column of sums holds
// its row's sum over the block's keys (all threads of the quad); sums start at zero each batch.
template <class TiledMmaPV, class TiledMmaSums, class TensorA, class TensorV, class TensorO, class TensorOnes,
          class TensorSums>
__device__ __forceinline__ void wgmma_gemm_with_row_sums(TiledMmaPV& mma_pv, TiledMmaSums& mma_sums, TensorA const& tA,
                                                         TensorV const& tV, TensorO& tO, TensorOnes const& tOnes,
                                                         TensorSums& tSums) {
  warpgroup_fence_operand(const_cast<TensorA&>(tA));
  warpgroup_fence_operand(tO);
  warpgroup_fence_operand(tSums);
  warpgroup_arrive();
  mma_pv.accumulate_ = GMMA::ScaleOut::One;
  mma_sums.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma_pv, tA(_, _, k), tV(_, _, k), tO);
    cute::gemm(mma_sums, tA(_, _, k), tOnes(_, _, k), tSums);
    mma_sums.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(tSums);
  warpgroup_fence_operand(tO);
  warpgroup_fence_operand(const_cast<TensorA&>(tA));
}

// The same pointer, opaque to the compiler. WGMMA descriptors built from it inside a loop are
// computed where they are used (a few integer ops) instead of hoisted out of the loop and kept
// live, one 64-bit register pair per K slice, across it: in kernels at the register limit those
// hoisted descriptors are what spills.
template <class T>
__device__ __forceinline__ T* opaque(T* ptr) {
  auto address = reinterpret_cast<uintptr_t>(ptr);
  asm volatile("" : "+l"(address));
  return reinterpret_cast<T*>(address);
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

// An fp8 register-sourced WGMMA takes K = 32 per instruction, and its A fragment holds, per thread t
// of a quad, the columns 4t..4t+3 and 16+4t..16+4t+3 of each 32-column slab, while the fp32
// accumulator holds 2t, 2t+1, 8+2t, 8+2t+1, ... No data moves between threads: each thread's eight
// accumulator values of a slab row go to its own eight A slots, in key order
//     slot 4t + a + 16h  <-  column 2t + (a & 1) + 8 (a >> 1) + 16h,
// and V is stored with its keys in that same order (fa3gen.fp8), so P·V sums matching pairs.
// acc: ((2, 2, N/8), MMA_M, 1) fp32; a: ((4, 2, 2), MMA_M, N/32) of To (see fp8_a_operand_layout).
template <class TensorAcc>
__device__ __forceinline__ constexpr auto fp8_a_operand_layout(TensorAcc const&) {
  using Acc = typename TensorAcc::layout_type;
  constexpr int kMmaM = decltype(size<1>(Acc{}))::value;
  constexpr int kSlabs = decltype(size<0, 2>(Acc{}))::value / 4;
  static_assert(decltype(size<0, 2>(Acc{}))::value % 4 == 0, "fp8 P needs N to be a multiple of 32");
  return make_layout(Shape<Shape<_4, _2, _2>, Int<kMmaM>, Int<kSlabs>>{});
}

template <class To, class TensorAcc, class TensorA>
__device__ __forceinline__ void convert_to_fp8_a_operand(TensorAcc const& acc, TensorA& a) {
  using From = typename TensorAcc::value_type;  // fp32, or fp16 (scores_f16)
  cutlass::NumericArrayConverter<To, From, 4> convert;
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < size<1>(a); ++m) {
    CUTLASS_PRAGMA_UNROLL
    for (int slab = 0; slab < size<2>(a); ++slab) {
      CUTLASS_PRAGMA_UNROLL
      for (int half = 0; half < 2; ++half) {
        CUTLASS_PRAGMA_UNROLL
        for (int row = 0; row < 2; ++row) {
          cutlass::Array<From, 4> x;
          CUTLASS_PRAGMA_UNROLL
          for (int i = 0; i < 4; ++i) { x[i] = acc(make_coord(i & 1, row, 4 * slab + 2 * half + (i >> 1)), m, 0); }
          // The four slots of one (row, half) are one 32-bit register of the A fragment.
          *reinterpret_cast<cutlass::Array<To, 4>*>(&a(make_coord(0, row, half), m, slab)) = convert(x);
        }
      }
    }
  }
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
