// entry_points.cuh - defines the extern "C" functions of mograph_kernels.h for one dtype.
//
// Each ops_<dtype>.cu includes this with MOGRAPH_DTYPE (the C++ type) and MOGRAPH_SUFFIX (the name suffix)
// defined, so the three dtypes compile as three translation units, in parallel, from one definition.
#pragma once

#include "gelu.cuh"
#include "norm.cuh"

#define MOGRAPH_CAT_(a, b) a##b
#define MOGRAPH_CAT(a, b) MOGRAPH_CAT_(a, b)
#define MOGRAPH_FN(op) MOGRAPH_CAT(op, MOGRAPH_SUFFIX)

extern "C" {

MOGRAPH_API int MOGRAPH_FN(mograph_layer_norm_)(const void* x, const void* gamma, const void* beta, void* y,
                                                int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                                mograph_stream_t stream) {
    return mograph::layer_norm<MOGRAPH_DTYPE>(x, gamma, beta, y, rows, hidden, eps, flags, stream);
}

MOGRAPH_API int MOGRAPH_FN(mograph_rms_norm_)(const void* x, const void* gamma, void* y, int64_t rows,
                                              int64_t hidden, float eps, uint32_t flags, mograph_stream_t stream) {
    return mograph::rms_norm<MOGRAPH_DTYPE>(x, gamma, y, rows, hidden, eps, flags, stream);
}

MOGRAPH_API int MOGRAPH_FN(mograph_skip_layer_norm_)(const void* x, const void* skip, const void* bias,
                                                     const void* gamma, const void* beta, void* y, void* sum_out,
                                                     int64_t rows, int64_t hidden, float eps, uint32_t flags,
                                                     mograph_stream_t stream) {
    return mograph::skip_layer_norm<MOGRAPH_DTYPE>(x, skip, bias, gamma, beta, y, sum_out, rows, hidden, eps, flags,
                                                   stream);
}

MOGRAPH_API int MOGRAPH_FN(mograph_skip_rms_norm_)(const void* x, const void* skip, const void* bias,
                                                   const void* gamma, void* y, void* sum_out, int64_t rows,
                                                   int64_t hidden, float eps, uint32_t flags,
                                                   mograph_stream_t stream) {
    return mograph::skip_rms_norm<MOGRAPH_DTYPE>(x, skip, bias, gamma, y, sum_out, rows, hidden, eps, flags, stream);
}

MOGRAPH_API int MOGRAPH_FN(mograph_gelu_)(const void* x, void* y, int64_t n, uint32_t flags,
                                          mograph_stream_t stream) {
    return mograph::gelu<MOGRAPH_DTYPE>(x, y, n, flags, stream);
}

MOGRAPH_API int MOGRAPH_FN(mograph_bias_gelu_)(const void* x, const void* bias, void* y, int64_t rows,
                                               int64_t hidden, uint32_t flags, mograph_stream_t stream) {
    return mograph::bias_gelu<MOGRAPH_DTYPE>(x, bias, y, rows, hidden, flags, stream);
}

}  // extern "C"
