// Online softmax over the rows a thread holds of one warpgroup's score tile, in fp32 with exp2.
// Each row lives in the 4 threads of a quad, so row reductions are two xor-shuffles.
#pragma once
#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
#include <math_constants.h>

namespace fa3gen {

using namespace cute;

__device__ __forceinline__ float quad_allreduce_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

// exp2 of an fp16 pair: two fp16 MUFU ops (cuda_fp16's h2exp2 goes through fp32 and back).
__device__ __forceinline__ __half2 exp2_pair(__half2 x) {
  uint32_t y;
  asm("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(reinterpret_cast<uint32_t const&>(x)));
  return reinterpret_cast<__half2 const&>(y);
}

// exp2 of an fp16 pair on the FMA pipe instead of the MUFU (which the fp8 loop keeps as busy as
// the tensor cores): 2^x = 2^n * 2^f with n = round(x), f in [-0.5, 0.5], 2^f by a degree-2
// minimax polynomial (relative error 2.3e-3 with fp16 coefficients, e4m3's P keeps 3 bits), 2^n
// built from the bits of x + 1551: 1551 = 1536 + 15 has ulp 1, so its low mantissa bits end up
// holding 15 + n, the exponent field of 2^n. x is clamped at -14 (2^-14 is far below e4m3's
// smallest P), which keeps 15 + n in 1..24. Nine instructions for two exp2.
__device__ __forceinline__ __half2 exp2_pair_poly(__half2 x) {
  x = __hmax2(x, __float2half2_rn(-14.f));
  __half2 const magic = __float2half2_rn(1551.f);
  __half2 const t = __hadd2(x, magic);
  __half2 const f = __hsub2(x, __hsub2(t, magic));
  __half2 const p = __hfma2(__hfma2(f, __float2half2_rn(0.23842894f), __float2half2_rn(0.70344801f)), f,
                            __float2half2_rn(1.0f));
  uint32_t const scale = (reinterpret_cast<uint32_t const&>(t) << 10) & 0xFC00FC00u;  // 2^n in each half
  return __hmul2(p, reinterpret_cast<__half2 const&>(scale));
}

__device__ __forceinline__ float quad_allreduce_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// kProbLog2Scale: probabilities come out as 2^kProbLog2Scale * exp(...), up to 256 for 8, so that
// an fp8 P keeps the small ones in its normal range; the row sums carry the same factor, so O's
// normalization cancels it, and the LSE takes it out.
// kLazyRescaleLog2 >= 0 (lazy rescale): a key block raises the running max only when, in some row
// of the warp, its max exceeds the running one by more than 2^kLazyRescaleLog2 in probability;
// otherwise the stale max stays, this block's probabilities may reach 2^kLazyRescaleLog2, and O
// needs no rescale (its rows and the row sums share the stale max, so the result is exact). Past
// the first blocks the max rarely grows that much: most blocks skip the multiply of every O
// register. -1: the max follows every block's.
// kChains: each row's max and sum over a block run in that many independent chains (columns
// round-robin), combined at the end, so a warp has more than one dependent FMNMX/FADD in flight.
// kThreadSums false (row sums on the tensor cores): the kernel sums each block's P rows as P·1
// beside P·V and adds them in (add_row_sums); update leaves row_sum alone, saving an FADD a score,
// and row_sum holds whole rows' sums, rescaled with O (rescale_row_sums).
// kHalfScores (scores_f16, with the sums on the tensor cores and the eager rescale): S is fp16, and
// the max and the exp2 run on pairs of adjacent columns (one instruction for two scores). The
// exp2's offset is then an fp16 value; the running max is kept at the one whose offset that value
// is exactly (snapped), so O's rescale, the split-tile merge and the LSE use the offset P had.
// kExp2PolyEvery > 0 (with kHalfScores): every kExp2PolyEvery-th pair of a row takes its exp2 from
// exp2_pair_poly, the others from the MUFU.
template <int kRows, int kProbLog2Scale = 0, int kLazyRescaleLog2 = -1, int kChains = 1, bool kThreadSums = true,
          bool kHalfScores = false, int kExp2PolyEvery = 0>
struct OnlineSoftmax {
  static_assert(!kHalfScores || (kLazyRescaleLog2 < 0 && !kThreadSums && kChains == 1));
  float row_max[kRows];  // running max of raw scores; -inf until a row sees a visible key
  float row_sum[kRows];  // this thread's partial sum of exp(scale * (s - row_max)) (without kThreadSums: the row's)
  float scale_log2;      // softmax_scale * log2(e): exp(scale * x) == exp2(scale_log2 * x)

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_max[r] = -CUDART_INF_F; row_sum[r] = 0.f; }
  }

  // Turns scores S (rows, cols) into unnormalized probabilities in place and sets, per row, the
  // factor exp(scale * (old_max - new_max)) that O's rows must be multiplied by. A row whose max is
  // still -inf gets zeros, never NaN. block_scale > 0 multiplies this block's scores (an fp8 key
  // block's descale): it goes into the max once per row and into the exp2's FMA, not per score.
  // Returns whether O needs that rescale (the same in every thread of the warp): always, unless lazy.
  template <class TensorS>
  __device__ __forceinline__ bool update(TensorS& s, float (&rescale)[kRows], float block_scale = 1.f) {
    static_assert(decltype(size<0>(s))::value == kRows);
    if constexpr (kHalfScores) {
      update_pairs(s, rescale, block_scale);
      return true;
    }
    float block_max[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kChains; ++i) { m[i] = -CUDART_INF_F; }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) { m[c % kChains] = fmaxf(m[c % kChains], s(r, c)); }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 1; i < kChains; ++i) { m[0] = fmaxf(m[0], m[i]); }
      block_max[r] = quad_allreduce_max(m[0]) * block_scale;
    }
    bool raise = true;
    if constexpr (kLazyRescaleLog2 >= 0) {
      bool grows = false;  // a row's first visible key: -inf to finite grows by inf
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) { grows |= (block_max[r] - row_max[r]) * scale_log2 > float(kLazyRescaleLog2); }
      raise = __any_sync(0xffffffff, grows);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const new_max = raise ? fmaxf(row_max[r], block_max[r]) : row_max[r];
      rescale[r] = !raise ? 1.f : row_max[r] == -CUDART_INF_F ? 0.f : exp2f((row_max[r] - new_max) * scale_log2);
      float const offset = (new_max == -CUDART_INF_F ? 0.f : new_max * scale_log2) - float(kProbLog2Scale);
      row_max[r] = new_max;
      float sum[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kChains; ++i) { sum[i] = 0.f; }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(s); ++c) {
        s(r, c) = exp2f(fmaf(s(r, c), scale_log2 * block_scale, -offset));
        if constexpr (kThreadSums) { sum[c % kChains] += s(r, c); }
      }
      if constexpr (kThreadSums) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 1; i < kChains; ++i) { sum[0] += sum[i]; }
        row_sum[r] = fmaf(row_sum[r], rescale[r], sum[0]);
      }
    }
    return raise;
  }

  // kHalfScores: update on fp16 scores, two adjacent columns (one 32-bit register) at a time.
  template <class TensorS>
  __device__ __forceinline__ void update_pairs(TensorS& s, float (&rescale)[kRows], float block_scale) {
    static_assert(cute::is_same_v<typename TensorS::value_type, cutlass::half_t>);
    constexpr int kPairs = decltype(size<1>(s))::value / 2;
    static_assert(kPairs * 2 == decltype(size<1>(s))::value);
    // Columns 2j and 2j + 1 of a row are adjacent halves of one accumulator register.
    auto pair = [&](int r, int j) -> __half2& { return *reinterpret_cast<__half2*>(&s(r, 2 * j)); };
    float block_max[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      __half2 m = pair(r, 0);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 1; j < kPairs; ++j) { m = __hmax2(m, pair(r, j)); }
      block_max[r] = quad_allreduce_max(fmaxf(__low2float(m), __high2float(m))) * block_scale;
    }
    __half2 const factor = __float2half2_rn(scale_log2 * block_scale);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float new_max = fmaxf(row_max[r], block_max[r]);
      // The exp2's offset as fp16, and the max snapped to it (unchanged if the max holds).
      float const offset = new_max == -CUDART_INF_F ? -float(kProbLog2Scale)
                                                      : __half2float(__float2half_rn(new_max * scale_log2 - float(kProbLog2Scale)));
      if (new_max != -CUDART_INF_F && scale_log2 != 0.f) { new_max = __fdividef(offset + float(kProbLog2Scale), scale_log2); }
      rescale[r] = row_max[r] == -CUDART_INF_F ? 0.f : exp2f((row_max[r] - new_max) * scale_log2);
      row_max[r] = new_max;
      __half2 const neg_offset = __float2half2_rn(-offset);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kPairs; ++j) {
        __half2 const x = __hfma2(pair(r, j), factor, neg_offset);
        pair(r, j) = kExp2PolyEvery > 0 && j % kExp2PolyEvery == kExp2PolyEvery - 1 ? exp2_pair_poly(x) : exp2_pair(x);
      }
    }
  }

  template <class TensorO>
  __device__ __forceinline__ static void rescale_rows(TensorO& o, float const (&rescale)[kRows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= rescale[r]; }
    }
  }

  // Without kThreadSums: a completed P·1 of one key block (rows, 8 columns that all hold the row's
  // sum) into the row sums. Summed per block and added here in fp32: an fp8 WGMMA accumulates with
  // fewer bits than fp32 (outputs 1e-2 to 3e-1 off at 2k-16k keys when the sums ran on in it).
  template <class TensorSums>
  __device__ __forceinline__ void add_row_sums(TensorSums const& sums) {
    static_assert(!kThreadSums);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_sum[r] += sums(r, 0); }
  }

  // Without kThreadSums: the row sums follow O's rescale.
  __device__ __forceinline__ void rescale_row_sums(float const (&rescale)[kRows]) {
    static_assert(!kThreadSums);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) { row_sum[r] *= rescale[r]; }
  }

  // Normalizes O's rows (times out_scale) and returns each row's log-sum-exp (natural log); empty
  // rows: O = 0, -inf.
  template <class TensorO>
  __device__ __forceinline__ void finish(TensorO& o, float softmax_scale, float (&lse)[kRows], float out_scale = 1.f) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float const sum = kThreadSums ? quad_allreduce_sum(row_sum[r]) : row_sum[r];
      bool const empty = sum == 0.f || sum != sum;
      float const inv = empty ? 0.f : out_scale / sum;
      lse[r] = empty ? -CUDART_INF_F : row_max[r] * softmax_scale + __logf(sum) - float(kProbLog2Scale) * float(M_LN2);
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < size<1>(o); ++c) { o(r, c) *= inv; }
    }
  }
};

}  // namespace fa3gen
