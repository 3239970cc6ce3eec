// gelu.cuh - elementwise Gelu and BiasGelu (gelu(x + bias[column])).
//
// Gelu: each thread loads its UNROLL packs of 16 bytes before computing, so enough independent loads are in
// flight to reach HBM bandwidth; blocks work in groups that spread a thread's packs apart (see gelu_kernel;
// the group size, cache hints and register cap per dtype, form and GPU architecture come from launch_table.cuh).
// BiasGelu: a thread owns one column pack of the [rows, hidden] view, keeps its bias pack in registers as
// fp32 and walks down UNROLL rows at a time, so the bias costs neither a load nor an index computation per
// element.
//
// Math, in fp32. Exact form: gelu(x) = x Phi(x) with Phi(x) = 1 - q for x >= 0 and q for x < 0, where
// q = erfc(|x| / sqrt 2) / 2. The library erff costs ~33 instructions an element, which made fp16/bf16 Gelu
// compute-bound at ~0.77 of HBM bandwidth on an H200; instead
//     q = t 2^(P(t) - x^2 log2(e) / 2),  t = 1 / (1 + z/2),  z = |x| / sqrt 2,
// with P a polynomial fitted here (weighted least squares towards minimax, z in [0, 10]) to
// log2(erfc(z) e^(z^2) / (2t)): about 20 instructions, one reciprocal and one exp2, and relative accuracy in
// both tails (no 1 + erf cancellation). Fit error of P: 4.5e-8 relative (degree 9, for fp32) and 1.1e-5
// absolute (degree 5, for fp16/bf16, whose own rounding is 5e-4 to 4e-3; the fp16/bf16 kernels issue
// enough instructions per byte that two fewer FMAs an element show in their bandwidth). In fp32 the result is
// within 1.5e-6 relative for |x| < 5 and 1e-5 beyond (there the rounding of x^2 in the exponent dominates,
// as it does for erfcf(x / sqrt 2)); with the degree-5 P, within 1.8e-5 relative for |x| < 12 (float32
// emulation against float64 erfc, before the rounding to fp16/bf16).
// Tanh form: 0.5 x (1 + tanh(u)) = x / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3): the same
// function without the cancellation of 1 + tanh(u) near -1; fp32 uses the accurate expf, fp16/bf16 __expf.
#pragma once

#include "common.cuh"
#include "launch_table.cuh"

namespace mograph {

// 2^a by the special-function unit (relative error ~2^-22); results below 2^-126 flush to 0.
__device__ __forceinline__ float exp2_approx(float a) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// 1 / a by the special-function unit (within 1 ulp).
__device__ __forceinline__ float rcp_approx(float a) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

// P(t), Horner form, highest coefficient first.
template <bool PRECISE>
__device__ __forceinline__ float gelu_tail_poly(float t) {
    if constexpr (PRECISE) {
        float p = 0.20514574646949768f;
        p = fmaf(p, t, -0.9609339833259583f);
        p = fmaf(p, t, 1.6192846298217773f);
        p = fmaf(p, t, -0.9395337700843811f);
        p = fmaf(p, t, -0.16852271556854248f);
        p = fmaf(p, t, 0.029164033010601997f);
        p = fmaf(p, t, 0.04089827090501785f);
        p = fmaf(p, t, 0.559624195098877f);
        p = fmaf(p, t, 1.4405198097229004f);
        return fmaf(p, t, -2.825646162033081f);
    } else {
        float p = 0.3301052451133728f;
        p = fmaf(p, t, -1.0232325792312622f);
        p = fmaf(p, t, 0.684640109539032f);
        p = fmaf(p, t, 0.3670397996902466f);
        p = fmaf(p, t, 1.468692660331726f);
        return fmaf(p, t, -2.8272342681884766f);
    }
}

template <bool TANH, bool PRECISE>
__device__ __forceinline__ float gelu_f32(float x) {
    if constexpr (TANH) {
        const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
        const float e = PRECISE ? expf(-2.0f * u) : __expf(-2.0f * u);
        return __fdividef(x, 1.0f + e);  // a denominator past 2^126 gives 0: the true value is below 1e-37
    } else {
        const float t = rcp_approx(fmaf(fabsf(x), 0.35355339059327373f, 1.0f));  // 1 / (1 + |x| / sqrt 8)
        const float q = t * exp2_approx(fmaf(-0.7213475204444817f * x, x, gelu_tail_poly<PRECISE>(t)));
        return x * (x >= 0.0f ? 1.0f - q : q);  // gelu(+inf) = inf; gelu(-inf) = -inf * 0 = NaN, as in PyTorch
    }
}

// minBlocksPerMultiprocessor for __launch_bounds__: 0 (no cap, ptxas's default; an explicit 1 lets it take
// more registers) when min_threads asks for less than one block.
constexpr int min_blocks_for(int min_threads, int block_threads) {
    return min_threads / block_threads < 1 ? 0 : (min_threads / block_threads > 32 ? 32 : min_threads / block_threads);
}

// x, y: n_packs packs of VEC elements, then `tail` scalars. Layout: the grid is GROUP-block groups (gridDim.x a
// multiple of GROUP); group g covers the GROUP x UNROLL x THREADS consecutive packs from g x that, and its
// block s takes packs s x THREADS + u x GROUP x THREADS + threadIdx.x (u < UNROLL). GROUP = 1: each block a
// contiguous chunk, a thread's packs THREADS apart; larger groups spread a thread's packs further apart.
template <typename T, int VEC, int UNROLL, int THREADS, bool TANH, int HINTS, int MINB, int GROUP>
__global__ void __launch_bounds__(THREADS, MINB) gelu_kernel(const T* __restrict__ x, T* __restrict__ y,
                                                             int64_t n_packs, int tail) {
    constexpr bool kPrecise = std::is_same<T, float>::value;
    constexpr int64_t kSpan = static_cast<int64_t>(GROUP) * UNROLL * THREADS;
    pdl_trigger();
    pdl_wait();
    const int64_t step = static_cast<int64_t>(GROUP) * THREADS;  // between a thread's unrolled packs
    const int64_t groups = gridDim.x / GROUP;
    const int64_t lane = static_cast<int64_t>(blockIdx.x % GROUP) * THREADS + threadIdx.x;

    for (int64_t g = blockIdx.x / GROUP; g * kSpan < n_packs; g += groups) {
        const int64_t first = g * kSpan + lane;
        Pack<T, VEC> in[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = first + static_cast<int64_t>(u) * step;
            if (i < n_packs) in[u] = load_stream<T, VEC, HINTS>(x + i * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t i = first + static_cast<int64_t>(u) * step;
            if (i < n_packs) {
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = gelu_f32<TANH, kPrecise>(to_f32(pack_elem(in[u], j)));
                store_stream<T, VEC, HINTS>(y + i * VEC, pack_from_f32<T, VEC>(f));
            }
        }
    }

    // A size that is not a multiple of VEC: the last few elements, one per thread of block 0.
    if constexpr (VEC > 1) {
        if (blockIdx.x == 0 && static_cast<int>(threadIdx.x) < tail) {
            const int64_t i = n_packs * VEC + threadIdx.x;
            y[i] = from_f32<T>(gelu_f32<TANH, kPrecise>(to_f32(x[i])));
        }
    }
}

// BiasGelu, column-owning form. Block (bx, by): thread (tx, ty) owns column pack blockIdx.x * bx + tx and,
// like gelu_kernel's packs, rows in groups of GROUP blocks along y: block-group g covers the
// GROUP x UNROLL x by consecutive rows from g x that, and its block s takes rows (u x GROUP + s) x by + ty
// (u < UNROLL), g stepping over the grid. GROUP = 1: a block's rows are consecutive; larger groups spread a
// thread's rows further apart (fp32 rows of 1024: 4 KB apart at GROUP 1, 16 KB at 4). No barriers, so
// threads past the last column simply return.
template <typename T, int VEC, int UNROLL, bool TANH, int HINTS, int MINB, int GROUP>
__global__ void __launch_bounds__(256, MINB) bias_gelu_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                                                              T* __restrict__ y, int64_t rows, int cols_packs) {
    constexpr bool kPrecise = std::is_same<T, float>::value;
    pdl_trigger();
    pdl_wait();
    const int c = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= cols_packs) return;
    float b[VEC];
    {
        const Pack<T, VEC> bp = load_pack<T, VEC>(bias + static_cast<int64_t>(c) * VEC);
#pragma unroll
        for (int j = 0; j < VEC; ++j) b[j] = to_f32(pack_elem(bp, j));
    }
    const int64_t span = static_cast<int64_t>(blockDim.y) * UNROLL * GROUP;  // rows of one block-group
    const int64_t step = static_cast<int64_t>(blockDim.y) * GROUP;          // between a thread's rows
    const int64_t row_stride = static_cast<int64_t>(cols_packs) * VEC;      // elements between rows
    const int64_t first = static_cast<int64_t>(blockIdx.y % GROUP) * blockDim.y + threadIdx.y;
    for (int64_t base = static_cast<int64_t>(blockIdx.y / GROUP) * span + first; base - first < rows;
         base += static_cast<int64_t>(gridDim.y / GROUP) * span) {
        Pack<T, VEC> in[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t r = base + static_cast<int64_t>(u) * step;
            if (r < rows) in[u] = load_stream<T, VEC, HINTS>(x + r * row_stride + static_cast<int64_t>(c) * VEC);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int64_t r = base + static_cast<int64_t>(u) * step;
            if (r < rows) {
                float f[VEC];
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = gelu_f32<TANH, kPrecise>(to_f32(pack_elem(in[u], j)) + b[j]);
                store_stream<T, VEC, HINTS>(y + r * row_stride + static_cast<int64_t>(c) * VEC,
                                            pack_from_f32<T, VEC>(f));
            }
        }
    }
}

template <typename T, int VEC, bool TANH, int ARCH>
int launch_bias_gelu_kernel(const T* x, const T* bias, T* y, int64_t rows, int cols_packs, cudaStream_t stream) {
    constexpr int kUnroll = 4;
    constexpr GeluTune kTune = gelu_launch<T, true, TANH, ARCH>();
    // Column packs per block: a power of two up to 32 for narrow rows (a warp then spans whole rows), else
    // whole warps up to 256; the rest of the 256 threads go down the rows.
    int bx = 1;
    if (cols_packs <= 32) {
        while (bx < cols_packs) bx *= 2;
    } else {
        bx = cols_packs >= 256 ? 256 : (cols_packs + 31) / 32 * 32;
    }
    const int by = 256 / bx;
    constexpr int kGroup = kTune.group < 1 ? 1 : kTune.group;
    const unsigned int gx = static_cast<unsigned int>((cols_packs + bx - 1) / bx);
    const int64_t span = int64_t{by} * kUnroll * kGroup;
    int64_t groups = (rows + span - 1) / span;
    if (groups > 65535 / kGroup) groups = 65535 / kGroup;  // gridDim.y limit: the kernel loops when this bites
    return launch_kernel(
        bias_gelu_kernel<T, VEC, kUnroll, TANH, kTune.hints, min_blocks_for(kTune.min_threads, 256), kGroup>,
        dim3(gx, static_cast<unsigned int>(groups * kGroup)), dim3(bx, by), 0, stream, x, bias, y, rows, cols_packs);
}

template <typename T, int VEC, bool TANH>
int launch_bias_gelu_arch(const T* x, const T* bias, T* y, int64_t rows, int cols_packs, cudaStream_t stream) {
    return table_arch() == kArchSm90
               ? launch_bias_gelu_kernel<T, VEC, TANH, kArchSm90>(x, bias, y, rows, cols_packs, stream)
               : launch_bias_gelu_kernel<T, VEC, TANH, kArchDefault>(x, bias, y, rows, cols_packs, stream);
}

constexpr int kGeluThreads = 256;
constexpr int kGeluUnroll = 4;

template <typename T, int VEC, bool TANH, int ARCH>
int launch_gelu_kernel(const T* x, T* y, int64_t n_packs, int tail, cudaStream_t stream) {
    constexpr GeluTune kTune = gelu_launch<T, false, TANH, ARCH>();
    constexpr int kGroup = kTune.group < 1 ? 1 : kTune.group;
    const int64_t span = int64_t{kGroup} * kGeluUnroll * kGeluThreads;
    int64_t groups = ((n_packs > 0 ? n_packs : 1) + span - 1) / span;
    const int64_t max_groups = 0x7fffffff / kGroup;
    if (groups > max_groups) groups = max_groups;  // the kernel loops when this bites
    return launch_kernel(gelu_kernel<T, VEC, kGeluUnroll, kGeluThreads, TANH, kTune.hints,
                                     min_blocks_for(kTune.min_threads, kGeluThreads), kGroup>,
                         dim3(static_cast<unsigned int>(groups * kGroup)), dim3(kGeluThreads), 0, stream, x, y, n_packs,
                         tail);
}

template <typename T, int VEC>
int launch_gelu_mode(bool tanh_mode, const T* x, T* y, int64_t n_packs, int tail, cudaStream_t stream) {
    if (table_arch() == kArchSm90) {
        return tanh_mode ? launch_gelu_kernel<T, VEC, true, kArchSm90>(x, y, n_packs, tail, stream)
                         : launch_gelu_kernel<T, VEC, false, kArchSm90>(x, y, n_packs, tail, stream);
    }
    return tanh_mode ? launch_gelu_kernel<T, VEC, true, kArchDefault>(x, y, n_packs, tail, stream)
                     : launch_gelu_kernel<T, VEC, false, kArchDefault>(x, y, n_packs, tail, stream);
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
        return launch_gelu_mode<T, kVec>(tanh_mode, x, y, n / kVec, static_cast<int>(n % kVec), stream);
    }
    return launch_gelu_mode<T, 1>(tanh_mode, x, y, n, 0, stream);
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
    const bool vector_ok = hidden % kVec == 0 && aligned16(x) && aligned16(bias) && aligned16(y);
    const int h = static_cast<int>(hidden);
    if (vector_ok) {
        return tanh_mode ? launch_bias_gelu_arch<T, kVec, true>(x, bias, y, rows, h / kVec, stream)
                         : launch_bias_gelu_arch<T, kVec, false>(x, bias, y, rows, h / kVec, stream);
    }
    return tanh_mode ? launch_bias_gelu_arch<T, 1, true>(x, bias, y, rows, h, stream)
                     : launch_bias_gelu_arch<T, 1, false>(x, bias, y, rows, h, stream);
}

}  // namespace mograph
