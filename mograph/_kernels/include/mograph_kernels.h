/*
 * mograph_kernels.h - C ABI of mograph's fused-op CUDA kernels.
 *
 * Every launch function enqueues work on `stream` and returns at once; it never synchronizes and never
 * allocates. All pointers are raw device pointers to contiguous, row-major data of the function's dtype
 * (gamma, beta and bias have the same dtype as x). Optional inputs and outputs are passed as NULL.
 * Arithmetic is done in fp32 whatever the storage dtype; results are rounded to nearest-even once.
 *
 * Row-wise ops work on a [rows, hidden] view: every row of `hidden` elements is normalized on its own.
 * `y` may be the same buffer as `x` (in place); no other overlap between inputs and outputs is allowed.
 *
 * Return value: MOGRAPH_OK (0) on success; MOGRAPH_ERR_INVALID_ARGUMENT for a NULL required pointer,
 * a negative size, hidden < 1 with rows > 0, or unknown flag bits; MOGRAPH_ERR_UNSUPPORTED for a size the
 * kernels cannot index (hidden > INT32_MAX); MOGRAPH_ERR_CUDA_BASE + e when the launch failed with
 * cudaError_t e (as reported by cudaGetLastError right after the launch). rows == 0 or n == 0 is a no-op
 * that returns MOGRAPH_OK.
 *
 * Suffixes: _f32 = float, _f16 = IEEE half (__half), _bf16 = bfloat16 (__nv_bfloat16).
 * Loading through ctypes: every pointer and the stream are c_void_p, sizes are c_int64, eps is c_float,
 * flags is c_uint32, the return value is c_int.
 */
#ifndef MOGRAPH_KERNELS_H_
#define MOGRAPH_KERNELS_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define MOGRAPH_API __declspec(dllexport)
#else
#define MOGRAPH_API __attribute__((visibility("default")))
#endif

/* Same type as cudaStream_t, declared here so that this header needs no CUDA header. NULL = legacy stream. */
typedef struct CUstream_st* mograph_stream_t;

/* Version of this ABI; bumped on any incompatible change of a signature or of the meaning of a flag. */
#define MOGRAPH_KERNELS_ABI_VERSION 1

/* Status codes. */
#define MOGRAPH_OK 0
#define MOGRAPH_ERR_INVALID_ARGUMENT 1
#define MOGRAPH_ERR_UNSUPPORTED 2
#define MOGRAPH_ERR_CUDA_BASE 1000

/* Flags of mograph_gelu_* and mograph_bias_gelu_*. The norm ops take no flags yet: pass 0. */
#define MOGRAPH_GELU_TANH 1u /* tanh approximation instead of the exact erf form */

/* Returns MOGRAPH_KERNELS_ABI_VERSION of the library that was built. */
MOGRAPH_API int mograph_kernels_abi_version(void);

/* Returns a static, human-readable description of a status code (never NULL). */
MOGRAPH_API const char* mograph_kernels_status_string(int status);

/*
 * LayerNorm over the last axis: y = (x - mean) / sqrt(var + eps) * gamma (+ beta), var the population
 * variance. x, y: [rows, hidden]; gamma: [hidden]; beta: [hidden] or NULL. flags: 0.
 */
MOGRAPH_API int mograph_layer_norm_f32(const void* x, const void* gamma, const void* beta, void* y,
                                       int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                       mograph_stream_t stream);
MOGRAPH_API int mograph_layer_norm_f16(const void* x, const void* gamma, const void* beta, void* y,
                                       int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                       mograph_stream_t stream);
MOGRAPH_API int mograph_layer_norm_bf16(const void* x, const void* gamma, const void* beta, void* y,
                                        int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                        mograph_stream_t stream);

/* RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) * gamma. x, y: [rows, hidden]; gamma: [hidden].
 * flags: 0. */
MOGRAPH_API int mograph_rms_norm_f32(const void* x, const void* gamma, void* y, int64_t rows,
                                     int64_t hidden, float eps, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_rms_norm_f16(const void* x, const void* gamma, void* y, int64_t rows,
                                     int64_t hidden, float eps, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_rms_norm_bf16(const void* x, const void* gamma, void* y, int64_t rows,
                                      int64_t hidden, float eps, uint32_t flags, mograph_stream_t stream);

/*
 * SkipLayerNorm: s = x + skip (+ bias), computed in fp32 and rounded once to the dtype; y = LayerNorm(s) of
 * that rounded s, with gamma and optional beta; sum_out, when not NULL, receives s. x, skip, y, sum_out:
 * [rows, hidden]; bias, gamma, beta: [hidden]; bias and beta may be NULL. sum_out must not overlap any
 * input. flags: 0.
 */
MOGRAPH_API int mograph_skip_layer_norm_f32(const void* x, const void* skip, const void* bias,
                                            const void* gamma, const void* beta, void* y, void* sum_out,
                                            int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                            mograph_stream_t stream);
MOGRAPH_API int mograph_skip_layer_norm_f16(const void* x, const void* skip, const void* bias,
                                            const void* gamma, const void* beta, void* y, void* sum_out,
                                            int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                            mograph_stream_t stream);
MOGRAPH_API int mograph_skip_layer_norm_bf16(const void* x, const void* skip, const void* bias,
                                             const void* gamma, const void* beta, void* y, void* sum_out,
                                             int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                             mograph_stream_t stream);

/*
 * SkipRMSNorm: s = x + skip (+ bias), computed in fp32 and rounded once to the dtype; y = RMSNorm(s) of that
 * rounded s, with gamma; sum_out, when not NULL, receives s. x, skip, y, sum_out: [rows, hidden]; bias,
 * gamma: [hidden]; bias may be NULL. sum_out must not overlap any input. flags: 0.
 */
MOGRAPH_API int mograph_skip_rms_norm_f32(const void* x, const void* skip, const void* bias, const void* gamma,
                                          void* y, void* sum_out, int64_t rows, int64_t hidden, float eps,
                                          uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_skip_rms_norm_f16(const void* x, const void* skip, const void* bias, const void* gamma,
                                          void* y, void* sum_out, int64_t rows, int64_t hidden, float eps,
                                          uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_skip_rms_norm_bf16(const void* x, const void* skip, const void* bias, const void* gamma,
                                           void* y, void* sum_out, int64_t rows, int64_t hidden, float eps,
                                           uint32_t flags, mograph_stream_t stream);

/*
 * Gelu over n elements (any shape, contiguous). flags = 0: y = 0.5 x (1 + erf(x / sqrt(2)));
 * flags = MOGRAPH_GELU_TANH: y = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))).
 */
MOGRAPH_API int mograph_gelu_f32(const void* x, void* y, int64_t n, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_gelu_f16(const void* x, void* y, int64_t n, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_gelu_bf16(const void* x, void* y, int64_t n, uint32_t flags, mograph_stream_t stream);

/* BiasGelu: y = gelu(x + bias), the sum kept in fp32 (not rounded to the dtype before the gelu).
 * x, y: [rows, hidden]; bias: [hidden]; flags as for mograph_gelu_*. */
MOGRAPH_API int mograph_bias_gelu_f32(const void* x, const void* bias, void* y, int64_t rows,
                                      int64_t hidden, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_bias_gelu_f16(const void* x, const void* bias, void* y, int64_t rows,
                                      int64_t hidden, uint32_t flags, mograph_stream_t stream);
MOGRAPH_API int mograph_bias_gelu_bf16(const void* x, const void* bias, void* y, int64_t rows,
                                       int64_t hidden, uint32_t flags, mograph_stream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOGRAPH_KERNELS_H_ */
