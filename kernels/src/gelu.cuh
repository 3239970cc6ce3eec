// gelu.cuh - elementwise Gelu and BiasGelu (gelu(x + bias[column])).
//
// One grid-stride kernel serves both. Each thread keeps UNROLL independent 16-byte loads in flight
// before computing, which is what an elementwise op needs to reach HBM bandwidth. For BiasGelu the bias
// column of each access is tracked incrementally (one 64-bit modulo per thread, then adds and compares),
// because a division per access would cost more than the math.
//
// Math, in fp32:
//   exact: 0.5 x (1 + erf(x / sqrt 2)) = 0.5 x erfc(-x / sqrt 2). fp32 storage uses erfcf, which keeps full
//          relative accuracy in the negative tail where 1 + erf cancels; fp16/bf16 use the cheaper erff,
//          whose cancellation stays far below their rounding.
//   tanh:  0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same function
//          without the cancellation of 1 + tanh(u) near -1. fp32 storage uses expf and an IEEE division,
//          fp16/bf16 the hardware exp2 approximation (__expf) and a fast division.
#pragma once

#include "common.cuh"

namespace mograph {

template <bool TANH, bool PRECISE>
__device__ __forceinline__ float gelu_f32(float x) {
    if constexpr (TANH) {
        const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
        if constexpr (PRECISE) {
            return x / (1.0f + expf(-2.0f * u));
        } else {
            return __fdividef(x, 1.0f + __expf(-2.0f * u));
        }
    } else {
        if constexpr (PRECISE) {
            return 0.5f * x * erfcf(-0.7071067811865476f * x);
        } else {
            return 0.5f * x * (1.0f + erff(0.7071067811865476f * x));
        }
    }
}

// x, y: n_packs packs of VEC elements (then `tail` scalars for plain Gelu). bias: nullptr for plain Gelu,
// else [cols_packs] packs indexed by column (row width = cols_packs packs).
template <typename T, int VEC, int UNROLL, bool TANH, bool HAS_BIAS>
__global__ void __launch_bounds__(256) gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                   T* __restrict__ y, int64_t n_packs, int64_t cols_packs,
                                                   int tail) {
    constexpr bool kPrecise = std::is_same<T, float>::value;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

    int64_t col = 0;
    int64_t col_step = 0;         // stride mod row width
    int64_t col_step_outer = 0;   // UNROLL * stride mod row width
    if constexpr (HAS_BIAS) {
        col = first % cols_packs;
        col_step = stride % cols_packs;
        col_step_outer = (static_cast<int64_t>(UNROLL) * stride) % cols_packs;
    }

    for (int64_t base = first; base < n_packs; base += UNROLL * stride) {
        Pack<T, VEC> in[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = base + u * stride;
            if (i < n_packs) in[u] = load_pack<T, VEC>(x + i * VEC);
        }
        int64_t c = col;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = base + u * stride;
            if (i < n_packs) {
                Pack<T, VEC> b;
                if constexpr (HAS_BIAS) b = load_pack<T, VEC>(bias + c * VEC);
                Pack<T, VEC> o;
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    float v = to_f32(in[u].v[j]);
                    if constexpr (HAS_BIAS) v += to_f32(b.v[j]);
                    o.v[j] = from_f32<T>(gelu_f32<TANH, kPrecise>(v));
                }
                store_pack<T, VEC>(y + i * VEC, o);
            }
            if constexpr (HAS_BIAS) {
                c += col_step;
                if (c >= cols_packs) c -= cols_packs;
            }
        }
        if constexpr (HAS_BIAS) {
            col += col_step_outer;
            if (col >= cols_packs) col -= cols_packs;
        }
    }

    // Plain Gelu whose size is not a multiple of VEC: the last few elements, one per thread.
    if constexpr (!HAS_BIAS && VEC > 1) {
        if (first < tail) {
            const int64_t i = n_packs * VEC + first;
            y[i] = from_f32<T>(gelu_f32<TANH, kPrecise>(to_f32(x[i])));
        }
    }
}

constexpr int kGeluThreads = 256;
constexpr int kGeluUnroll = 4;

template <typename T, int VEC, bool TANH, bool HAS_BIAS>
int launch_gelu_kernel(const T* x, const T* bias, T* y, int64_t n_packs, int64_t cols_packs, int tail,
                       cudaStream_t stream) {
    const unsigned int grid = grid_for(n_packs > 0 ? n_packs : 1, int64_t{kGeluThreads} * kGeluUnroll);
    gelu_kernel<T, VEC, kGeluUnroll, TANH, HAS_BIAS>
        <<<grid, kGeluThreads, 0, stream>>>(x, bias, y, n_packs, cols_packs, tail);
    return launch_status();
}

template <typename T, int VEC, bool HAS_BIAS>
int launch_gelu_mode(bool tanh_mode, const T* x, const T* bias, T* y, int64_t n_packs, int64_t cols_packs, int tail,
                     cudaStream_t stream) {
    return tanh_mode ? launch_gelu_kernel<T, VEC, true, HAS_BIAS>(x, bias, y, n_packs, cols_packs, tail, stream)
                     : launch_gelu_kernel<T, VEC, false, HAS_BIAS>(x, bias, y, n_packs, cols_packs, tail, stream);
}

template <typename T>
int gelu(const void* x_, void* y_, int64_t n, uint32_t flags, cudaStream_t stream) {
    if ((flags & ~MOGRAPH_GELU_TANH) != 0 || n < 0) return MOGRAPH_ERR_INVALID_ARGUMENT;
    if (n == 0) return MOGRAPH_OK;
    if (x_ == nullptr || y_ == nullptr) return MOGRAPH_ERR_INVALID_ARGUMENT;
    const T* x = static_cast<const T*>(x_);
    T* y = static_cast<T*>(y_);
    const bool tanh_mode = (flags & MOGRAPH_GELU_TANH) != 0;
    constexpr int kVec = kVec16<T>;
    if (aligned16(x) && aligned16(y)) {
        return launch_gelu_mode<T, kVec, false>(tanh_mode, x, nullptr, y, n / kVec, 1, static_cast<int>(n % kVec),
                                                stream);
    }
    return launch_gelu_mode<T, 1, false>(tanh_mode, x, nullptr, y, n, 1, 0, stream);
}

template <typename T>
int bias_gelu(const void* x_, const void* bias_, void* y_, int64_t rows, int64_t hidden, uint32_t flags,
              cudaStream_t stream) {
    if ((flags & ~MOGRAPH_GELU_TANH) != 0 || rows < 0 || hidden < 0) return MOGRAPH_ERR_INVALID_ARGUMENT;
    if (rows == 0) return MOGRAPH_OK;
    if (hidden < 1 || x_ == nullptr || bias_ == nullptr || y_ == nullptr) return MOGRAPH_ERR_INVALID_ARGUMENT;
    if (hidden > 0x7fffffff) return MOGRAPH_ERR_UNSUPPORTED;
    const T* x = static_cast<const T*>(x_);
    const T* bias = static_cast<const T*>(bias_);
    T* y = static_cast<T*>(y_);
    const bool tanh_mode = (flags & MOGRAPH_GELU_TANH) != 0;
    constexpr int kVec = kVec16<T>;
    if (hidden % kVec == 0 && aligned16(x) && aligned16(bias) && aligned16(y)) {
        return launch_gelu_mode<T, kVec, true>(tanh_mode, x, bias, y, rows * (hidden / kVec), hidden / kVec, 0,
                                               stream);
    }
    return launch_gelu_mode<T, 1, true>(tanh_mode, x, bias, y, rows * hidden, hidden, 0, stream);
}

}  // namespace mograph
