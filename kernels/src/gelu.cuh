// gelu.cuh - elementwise Gelu and BiasGelu (gelu(x + bias[column])).
//
// One kernel serves both: each block takes a contiguous chunk of UNROLL x 256 packs of 16 bytes, and each
// thread loads its UNROLL packs before computing, so enough independent loads are in flight to reach HBM
// bandwidth. For BiasGelu the bias column of a thread's first pack costs one (32-bit when possible)
// modulo; the next ones follow by adding a constant step.
//
// Math, in fp32. Exact form: gelu(x) = x Phi(x) with Phi(x) = 1 - q for x >= 0 and q for x < 0, where
// q = erfc(|x| / sqrt 2) / 2. The library erff costs ~33 instructions an element, which made fp16/bf16 Gelu
// compute-bound; instead q = t exp(-x^2/2 + P(t)) with t = 1 / (1 + z/2), z = |x| / sqrt 2, and P a
// polynomial fitted here (weighted least squares towards minimax, z in [0, 10]) to ln(erfc(z) e^(z^2) / t)
// - ln 2: about 19 instructions, one reciprocal and one exponential, and relative accuracy in both tails
// (no 1 + erf cancellation). Fit error of P: 4.5e-8 (degree 9, fp32 data) and 6.4e-7 (degree 7, fp16/bf16,
// whose own rounding is 1e-3 to 1e-2). fp32 also splits x^2 = hi + lo exactly and uses the accurate expf on
// hi, so the deep negative tail keeps ~1e-6 relative accuracy (an fp32 z = x / sqrt 2 alone would cost 1e-5
// there). Tanh form: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same
// function without the cancellation of 1 + tanh(u) near -1; fp32 uses expf, fp16/bf16 __expf.
#pragma once

#include "common.cuh"

namespace mograph {

// P(t) coefficients, constant term first.
__device__ __forceinline__ float gelu_poly9(float t) {
    float p = 0.1421961933374405f;
    p = fmaf(p, t, -0.6660686731338501f);
    p = fmaf(p, t, 1.122402548789978f);
    p = fmaf(p, t, -0.6512351632118225f);
    p = fmaf(p, t, -0.11681104451417923f);
    p = fmaf(p, t, 0.02021496742963791f);
    p = fmaf(p, t, 0.028348522260785103f);
    p = fmaf(p, t, 0.3879019320011139f);
    p = fmaf(p, t, 0.9984922409057617f);
    return fmaf(p, t, -1.9585886001586914f);
}

__device__ __forceinline__ float gelu_poly7(float t) {
    float p = -0.1836673468351364f;
    p = fmaf(p, t, 0.7340124249458313f);
    p = fmaf(p, t, -0.970150351524353f);
    p = fmaf(p, t, 0.32093101739883423f);
    p = fmaf(p, t, -0.024188201874494553f);
    p = fmaf(p, t, 0.3892572522163391f);
    p = fmaf(p, t, 0.9993281364440918f);
    return fmaf(p, t, -1.958670735359192f);
}

template <bool TANH, bool PRECISE>
__device__ __forceinline__ float gelu_f32(float x) {
    if constexpr (TANH) {
        const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
        const float e = PRECISE ? expf(-2.0f * u) : __expf(-2.0f * u);
        return __fdividef(x, 1.0f + e);  // a denominator past 2^126 gives 0: the true value is below 1e-37
    } else {
        const float z = fabsf(x) * 0.7071067811865476f;
        float q;
        if constexpr (PRECISE) {
            const float t = __frcp_rn(fmaf(0.5f, z, 1.0f));
            const float hi = x * x;
            const float lo = fmaf(x, x, -hi);  // x^2 = hi + lo exactly
            q = t * expf(-0.5f * hi) * __expf(gelu_poly9(t)) * fmaf(-0.5f, lo, 1.0f);
        } else {
            const float t = __fdividef(1.0f, fmaf(0.5f, z, 1.0f));
            q = t * __expf(fmaf(-0.5f * x, x, gelu_poly7(t)));
        }
        const float m = q == 0.0f ? 0.0f : x * q;  // q == 0: |x| huge or infinite, where x * q is not 0
        return x >= 0.0f ? x - m : m;
    }
}

// x, y: n_packs packs of VEC elements (then `tail` scalars for plain Gelu). bias: nullptr for plain Gelu,
// else a row of cols_packs packs, indexed by column.
template <typename T, int VEC, int UNROLL, int THREADS, bool TANH, bool HAS_BIAS>
__global__ void __launch_bounds__(THREADS) gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                       T* __restrict__ y, int64_t n_packs, int64_t cols_packs,
                                                       int tail) {
    constexpr bool kPrecise = std::is_same<T, float>::value;
    constexpr int64_t kChunk = static_cast<int64_t>(UNROLL) * THREADS;
    int64_t col_step = 0;
    if constexpr (HAS_BIAS) col_step = THREADS % cols_packs;

    for (int64_t chunk = blockIdx.x; chunk * kChunk < n_packs; chunk += gridDim.x) {
        const int64_t first = chunk * kChunk + threadIdx.x;
        Pack<T, VEC> in[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = first + static_cast<int64_t>(u) * THREADS;
            if (i < n_packs) in[u] = load_stream<T, VEC>(x + i * VEC);
        }
        int64_t c = 0;
        if constexpr (HAS_BIAS) {
            c = n_packs <= 0xffffffffll ? static_cast<int64_t>(static_cast<uint32_t>(first) %
                                                               static_cast<uint32_t>(cols_packs))
                                        : first % cols_packs;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = first + static_cast<int64_t>(u) * THREADS;
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
                store_stream<T, VEC>(y + i * VEC, o);
            }
            if constexpr (HAS_BIAS) {
                c += col_step;
                if (c >= cols_packs) c -= cols_packs;
            }
        }
    }

    // Plain Gelu whose size is not a multiple of VEC: the last few elements, one per thread of block 0.
    if constexpr (!HAS_BIAS && VEC > 1) {
        if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < tail) {
            const int64_t i = n_packs * VEC + threadIdx.x;
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
    gelu_kernel<T, VEC, kGeluUnroll, kGeluThreads, TANH, HAS_BIAS>
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
