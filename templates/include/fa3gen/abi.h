// The C ABI between a compiled fa3gen kernel library and its caller (fa3gen/abi.py mirrors it).
// Plain C types only: the library must not depend on torch's or Python's ABI.
#pragma once
#include <stdint.h>

#define FA3GEN_ABI_VERSION 7
#define FA3GEN_MAX_SCALAR_ARGS 8
#define FA3GEN_MAX_TENSOR_ARGS 8
#define FA3GEN_MAX_TENSOR_DIMS 4

#ifdef __cplusplus
extern "C" {
#endif

// Run-time values of the attention variants, the same for the forward and its backward; a kernel
// reads only those its spec compiles in.
typedef struct Fa3genVariantParams {
  int32_t window_left, window_right;  // local window: keys [i + sk - sq - left, i + sk - sq + right], both >= 0
  float softcap;                      // soft-capping: score = softcap * tanh(score / softcap), > 0
  const float* alibi_slopes;          // ALiBi slope of (batch b, head h): alibi_slopes[b * alibi_batch_stride + h]
  int64_t alibi_batch_stride;
  float float_args[FA3GEN_MAX_SCALAR_ARGS];    // float32 scalar params, in declaration order
  int32_t int_args[FA3GEN_MAX_SCALAR_ARGS];    // int32 scalar params, in declaration order
  const void* tensor_args[FA3GEN_MAX_TENSOR_ARGS];                           // tensor params
  int64_t tensor_strides[FA3GEN_MAX_TENSOR_ARGS][FA3GEN_MAX_TENSOR_DIMS];  // their strides, in elements
} Fa3genVariantParams;

// FP8 descaling factors of one input (q, k or v): the value of row r of (batch b, head h) is its
// e4m3 value times scale[b * batch_stride + (r / block_rows) * block_stride + h * head_stride].
// Zero strides broadcast (per tensor: all zero; per (batch, head): block_stride zero). NULL: 1.
typedef struct Fa3genDescale {
  const float* scale;
  int64_t batch_stride, block_stride, head_stride;
  int32_t block_rows;  // rows per scale block, a multiple of the kernel's tile rows along that input
} Fa3genDescale;

// Forward attention problem. Tensors are laid out (batch, seqlen, nheads, headdim) with a
// contiguous last dimension; strides are in elements. lse is (batch, nheads_q, seqlen_q), contiguous.
typedef struct Fa3genFwdParams {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int32_t batch, seqlen_q, seqlen_k, nheads_q, nheads_kv;
  float softmax_scale;
  // Device scratch of at least fa3gen_fwd_workspace_bytes() bytes (NULL when that is 0), 16-byte
  // aligned: zeroed before its first launch, and every launch leaves it zeroed, so the caller keeps
  // one per stream and zeroes it once. Launches that may run at the same time need their own.
  void* workspace;
  Fa3genVariantParams variant;
  // e4m3 kernels only: the inputs' descaling factors. Their v is laid out (batch, nheads, head_dim,
  // keys) with keys padded to a multiple of 32 and stored in the order fa3gen.fp8 documents
  // (v_row_stride steps along head_dim); the other kernels ignore these.
  Fa3genDescale q_descale, k_descale, v_descale;
} Fa3genFwdParams;

// Backward problem: the forward's inputs, its output o and lse, the output gradient dout, and the
// gradients to write (dq like q, dk like k, dv like v). Same layout rules as the forward.
typedef struct Fa3genBwdParams {
  const void* q;
  const void* k;
  const void* v;
  const void* o;
  const void* dout;
  const float* lse;  // (batch, nheads_q, seqlen_q), contiguous, natural log, as the forward wrote it
  void* dq;
  void* dk;
  void* dv;
  int64_t q_batch_stride, q_row_stride, q_head_stride;
  int64_t k_batch_stride, k_row_stride, k_head_stride;
  int64_t v_batch_stride, v_row_stride, v_head_stride;
  int64_t o_batch_stride, o_row_stride, o_head_stride;
  int64_t dout_batch_stride, dout_row_stride, dout_head_stride;
  int64_t dq_batch_stride, dq_row_stride, dq_head_stride;
  int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
  int64_t dv_batch_stride, dv_row_stride, dv_head_stride;
  int32_t batch, seqlen_q, seqlen_k, nheads_q, nheads_kv;
  float softmax_scale;
  // Device scratch of at least fa3gen_bwd_workspace_bytes(params) bytes, 256-byte aligned, used by
  // this launch only (fp32 dQ accumulator, per-row softmax statistics, dQ ordering semaphores).
  void* workspace;
  Fa3genVariantParams variant;  // the forward's variant values
} Fa3genBwdParams;

// Every kernel library exports these two symbols ...
int fa3gen_abi_version(void);           // FA3GEN_ABI_VERSION it was built with
const char* fa3gen_spec_json(void);     // canonical JSON of the KernelSpec it was rendered from
// ... a forward library (kind "fwd") these two:
int fa3gen_fwd_workspace_bytes(void);   // scratch fa3gen_fwd needs in params->workspace (0: none)
// Launches the forward kernel on `stream` (a cudaStream_t). Returns a cudaError_t (0 = success).
int fa3gen_fwd(const Fa3genFwdParams* params, void* stream);
// ... and a backward library (kind "bwd") these two:
int64_t fa3gen_bwd_workspace_bytes(const Fa3genBwdParams* params);  // depends on the problem's sizes
// Launches the backward kernels (preprocess, main, dQ conversion) on `stream`; returns a cudaError_t.
int fa3gen_bwd(const Fa3genBwdParams* params, void* stream);

#ifdef __cplusplus
}
#endif
