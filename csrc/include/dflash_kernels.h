/*
 * dflash_kernels.h -- torch-free C ABI of the dflash-kernels C++/CUDA ops.
 *
 * Everything here is plain C: no PyTorch, no CUDA headers. A C/C++ engine that does not run
 * Python links libdflash_kernels_cuda (device launchers) and/or libdflash_kernels_cpu (host
 * reference implementations with exactly the same semantics) and calls these functions with
 * raw pointers. The PyTorch ops torch.ops.dflash_ext.* are thin wrappers over the same code.
 *
 * Conventions
 *   - All token ids, counts, lengths and positions are int64_t; flags are uint8_t (0/1, the
 *     layout of torch.bool). All arrays are dense row-major (C-contiguous).
 *   - Device launchers are asynchronous on `stream` and never synchronize the host, so they can
 *     be captured in CUDA graphs. They return 0 (cudaSuccess) or the cudaError_t of the launch.
 *   - Host functions return DFLASH_OK or a negative DFLASH_ERR_* code and write nothing when they
 *     fail argument checks (see each function).
 *
 * ---------------------------------------------------------------------------------------------
 * verify_greedy (greedy verification of one speculative block per request)
 *   logits        [N, B, V]  fp32 / fp16 / bf16  target logits at the B block positions
 *   draft_tokens  [N, B-1]   int64               the drafted tokens (B may be 1: no drafts)
 *   accepted      [N]        int64  (out)        largest a such that draft_tokens[n, j] ==
 *                                                argmax(logits[n, j]) for every j < a
 *   bonus         [N]        int64  (out)        argmax(logits[n, accepted[n]])
 *   argmax follows torch.argmax exactly: first index among ties, NaN counts as the maximum
 *   (first NaN wins).
 *   CUDA: one kernel launch. Blocks compute the partial argmax of one vocabulary split of one
 *   row (n, j); the last block to finish for request n (atomic counter) reduces the partials,
 *   compares with the drafts and writes accepted/bonus, then resets its counter to 0.
 *   The workspace (size from dflash_verify_greedy_workspace_bytes) holds the partials and N
 *   uint32 counters at its start; the counters must be ZERO before the first launch (memset
 *   once after allocating) and every launch leaves them zero again, so a workspace can be reused
 *   by launches on the same stream (and inside CUDA graphs). Do not share one workspace between
 *   launches that may run concurrently.
 *
 * commit_round (device-side bookkeeping of one decoding round, ragged batch of R requests)
 *   draft_tokens [R, B-1] int64   drafted tokens of this round (row stride B-1)
 *   accepted     [R]      int64   accepted draft count, 0 <= accepted[r] <= B-1
 *   bonus        [R]      int64   target token after the accepted prefix
 *   stop_tokens  [R, S] or [S] int64 (stop_row_stride = S or 0), negative entries are ignored;
 *                S may be 0 (stop_tokens may then be NULL)
 *   max_lengths  [R]      int64   a request is finished once lengths[r] >= max_lengths[r]
 *   out_tokens   [R, C]   int64   (in/out) output buffers, capacity C tokens per request
 *   lengths      [R]      int64   (in/out) tokens already in out_tokens[r]
 *   positions    [R]      int64   (in/out) sequence position of the current anchor token
 *   anchor       [R]      int64   (in/out) the current anchor (last committed) token
 *   done         [R]      uint8   (in/out) finished flag
 *   num_new      [R]      int64   (out)    tokens committed this round (= new context rows)
 *
 *   For every request r with done[r] == 0 (requests with done[r] != 0 are left untouched and get
 *   num_new[r] = 0):
 *     a       = accepted[r];  L = lengths[r]
 *     e[0..a] = draft_tokens[r, 0..a-1] followed by bonus[r]          (a + 1 candidate tokens)
 *     s       = 1 + index of the first e[j] (j <= a) that is a stop token, or a + 1 if none
 *     n       = min(s, max(max_lengths[r] - L, 0))                    (tokens committed)
 *     out_tokens[r, L .. L+n-1] = e[0 .. n-1]; nothing else of out_tokens[r] is written
 *     lengths[r] += n;  positions[r] += n;  num_new[r] = n;
 *     if n > 0: anchor[r] = e[n-1]
 *     done[r] = (a stop token was committed) || lengths[r] >= max_lengths[r]
 *   Valid input: 0 <= accepted[r] <= B-1, 0 <= lengths[r] <= C, max_lengths[r] <= C.
 *   The host function rejects invalid input (DFLASH_ERR_VALUE, nothing written). The device
 *   kernel cannot report errors without a host sync: it never reads or writes out of bounds and
 *   treats a not-done request with invalid values as finished (done[r] = 1, num_new[r] = 0,
 *   nothing else written).
 *   CUDA: one kernel launch, one thread per request.
 * ---------------------------------------------------------------------------------------------
 */
#ifndef DFLASH_KERNELS_H_
#define DFLASH_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Same declaration as the CUDA runtime's driver_types.h (a repeated identical typedef is legal). */
typedef struct CUstream_st* cudaStream_t;

#define DFLASH_KERNELS_ABI_VERSION 1

typedef enum dflash_dtype {
  DFLASH_DTYPE_F32 = 0,
  DFLASH_DTYPE_F16 = 1,
  DFLASH_DTYPE_BF16 = 2
} dflash_dtype;

enum {
  DFLASH_OK = 0,
  DFLASH_ERR_ARGUMENT = -1, /* NULL pointer, negative size, unknown dtype, workspace too small */
  DFLASH_ERR_VALUE = -2     /* a value outside its documented range (host functions only) */
};

/* ABI version this library was built with (DFLASH_KERNELS_ABI_VERSION). */
int dflash_kernels_abi_version(void);

/* ---------------------------------- host (CPU) reference --------------------------------- */

/* logits: host pointer of dtype `dtype`; returns DFLASH_OK or DFLASH_ERR_ARGUMENT. */
int dflash_verify_greedy_host(const void* logits, dflash_dtype dtype, const int64_t* draft_tokens,
                              int64_t N, int64_t B, int64_t V, int64_t* accepted, int64_t* bonus);

int dflash_commit_round_host(const int64_t* draft_tokens, const int64_t* accepted,
                             const int64_t* bonus, const int64_t* stop_tokens, int64_t num_stop,
                             int64_t stop_row_stride, const int64_t* max_lengths,
                             int64_t* out_tokens, int64_t* lengths, int64_t* positions,
                             int64_t* anchor, uint8_t* done, int64_t* num_new, int64_t R,
                             int64_t B, int64_t capacity);

/* ---------------------------------- device (CUDA) launchers ------------------------------ */
/* Defined in libdflash_kernels_cuda (csrc/cuda/dflash_kernels.cu). All pointers are device
 * pointers. `device_sm_count` may be 0 (the launcher then queries the current device). */

/* Bytes of workspace for a launch with these sizes (counters first, then partials). */
size_t dflash_verify_greedy_workspace_bytes(int64_t N, int64_t B, int64_t V, int device_sm_count);

int dflash_verify_greedy_cuda(const void* logits, dflash_dtype dtype, const int64_t* draft_tokens,
                              int64_t N, int64_t B, int64_t V, int64_t* accepted, int64_t* bonus,
                              void* workspace, size_t workspace_bytes, int device_sm_count,
                              cudaStream_t stream);

int dflash_commit_round_cuda(const int64_t* draft_tokens, const int64_t* accepted,
                             const int64_t* bonus, const int64_t* stop_tokens, int64_t num_stop,
                             int64_t stop_row_stride, const int64_t* max_lengths,
                             int64_t* out_tokens, int64_t* lengths, int64_t* positions,
                             int64_t* anchor, uint8_t* done, int64_t* num_new, int64_t R,
                             int64_t B, int64_t capacity, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DFLASH_KERNELS_H_ */
