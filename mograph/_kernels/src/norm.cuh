// norm.cuh - row-wise normalization kernels: LayerNorm, RMSNorm and SkipLayerNorm.
//
// Each op is one pass over HBM: a row is read once, its statistics are reduced in fp32, and the output
// is written once. Two kernels share the work:
//
// * norm_register_kernel (the fast path): taken when hidden is a multiple of the 16-byte vector width and
//   every pointer is 16-byte aligned. A group of TPR threads owns a row; each thread keeps VPT packs of
//   16 bytes of it in registers, so the row is loaded with LDG.128 and never re-read. Small rows use a
//   group of 4..32 lanes inside a warp (several rows per block, reduced with shuffles), large rows a group
//   of 2..32 warps (one row per block, reduced through shared memory). The cache hints of the activations
//   (see load_stream), a register cap, the block size of small rows and the layout (gamma/beta loaded with
//   the row or after the statistics; LayerNorm's mean and variance in two reductions or one merged one) come
//   from launch_table.cuh per launch shape and GPU architecture; gamma/beta always take the plain read-only path and stay cached
//   for the next rows. The statistics come from the registers: either the mean then the squared deviations
//   from it, or each thread's own mean and M2 merged across threads; both are exact where
//   E[x^2] - E[x]^2 would cancel. fp16/bf16 packs are converted a 32-bit word at a time (unpack_f32), and
//   rows that the launch shape covers exactly (768, 1024, 4096, 8192, ...) run an instance compiled
//   without per-pack bounds tests (fp16 LayerNorm at 768: 310 SASS instructions a row instead of 479 with
//   element-wise packs; instruction issue is what limits these kernels at small hidden sizes, BENCHMARKS.md).
// * norm_generic_kernel (any hidden, any alignment): scalar accesses, the row cached in shared memory as
//   fp32 when it fits (still one pass over HBM), otherwise re-read from global memory (L2) per phase.
//
// SkipLayerNorm and SkipRMSNorm round s = x + skip (+ bias) to the storage dtype before normalizing, so the fused op
// computes what the unfused Add -> LayerNorm graph computes, and its optional second output is exactly
// the tensor that was normalized.
#pragma once

#include "common.cuh"
#include "launch_table.cuh"

namespace mograph {

enum class NormKind : int { kLayerNorm = 0, kRmsNorm = 1, kSkipLayerNorm = 2, kSkipRmsNorm = 3 };

// SkipLayerNorm and SkipRMSNorm normalize x + skip (+ bias); LayerNorm and SkipLayerNorm subtract the mean
// (and add beta), the RMS kinds do not.
__host__ __device__ constexpr bool has_skip(NormKind k) { return k == NormKind::kSkipLayerNorm || k == NormKind::kSkipRmsNorm; }
__host__ __device__ constexpr bool centered(NormKind k) { return k == NormKind::kLayerNorm || k == NormKind::kSkipLayerNorm; }

template <typename T>
struct NormArgs {
    const T* x;
    const T* skip;   // SkipLayerNorm only
    const T* bias;   // SkipLayerNorm only, may be null
    const T* gamma;
    const T* beta;   // may be null; unused by RMSNorm
    T* y;
    T* sum_out;      // SkipLayerNorm only, may be null
    int64_t rows;
    int hidden;
    float eps;
    float inv_hidden;
};

// Sum over a group of TPR threads (TPR a power of two up to 32: lanes of one warp, aligned groups).
template <int TPR>
__device__ __forceinline__ float group_allreduce_sum(float v) {
#pragma unroll
    for (int mask = TPR / 2; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    return v;
}

// Sums over the TPR threads that own one row. For TPR > 32 the warps' partials meet in shared memory;
// two slots are used alternately so that one barrier per reduction is enough (a slot is written again only
// after every thread has passed the barrier of the reduction in between).
template <int TPR, int RPB>
struct RowReducer {
    static constexpr int kWarps = TPR > 32 ? TPR / 32 : 1;
    static constexpr int kFloats = 4 * RPB * kWarps;  // buf: [2][RPB][kWarps] sums or [2][RPB][kWarps][2] pairs
    float* buf;
    int parity;

    __device__ __forceinline__ float* slot(int row_in_block) {
        float* b = buf + parity * (RPB * kWarps) + row_in_block * kWarps;
        parity ^= 1;
        return b;
    }

    __device__ __forceinline__ float sum(float v, int row_in_block, int t) {
        if constexpr (TPR <= 32) {
            return group_allreduce_sum<TPR>(v);
        } else {
            v = warp_allreduce_sum(v);
            float* b = slot(row_in_block);
            if ((threadIdx.x & 31) == 0) b[t / 32] = v;
            __syncthreads();
            v = 0.f;
#pragma unroll
            for (int i = 0; i < kWarps; ++i) v += b[i];  // same order in every thread: identical results
            return v;
        }
    }

    // Mean and sum of squared deviations (M2) of the row in one reduction, from each thread's own mean and M2
    // over n elements (the same n in every thread: rows the launch shape covers exactly). Partial results of
    // equal counts merge as mean = (ma + mb) / 2, M2 = M2a + M2b + (mb - ma)^2 * n / 2 (Chan et al.), which
    // is as exact as the two-reduction form and needs half the dependent shuffle rounds and barriers. The
    // merge is symmetric in a and b, so every lane ends with bit-identical results.
    __device__ __forceinline__ void mean_m2(float& mean, float& m2, float n, int row_in_block, int t) {
        const int lanes = TPR < 32 ? TPR : 32;
#pragma unroll
        for (int mask = lanes / 2; mask > 0; mask >>= 1) {
            const float om = __shfl_xor_sync(0xffffffffu, mean, mask);
            const float om2 = __shfl_xor_sync(0xffffffffu, m2, mask);
            const float d = om - mean;
            m2 = (m2 + om2) + d * d * (0.5f * n);
            mean = 0.5f * (mean + om);
            n *= 2.f;
        }
        if constexpr (TPR > 32) {
            float* b = buf + 2 * (parity * (RPB * kWarps) + row_in_block * kWarps);  // [2][RPB][kWarps][2]
            parity ^= 1;
            if ((threadIdx.x & 31) == 0) {
                b[2 * (t / 32)] = mean;
                b[2 * (t / 32) + 1] = m2;
            }
            __syncthreads();
            mean = b[0];
            m2 = b[1];
#pragma unroll
            for (int w = 1; w < kWarps; ++w) {  // running merge, same order in every thread
                const float d = b[2 * w] - mean;
                const float f = 1.f / static_cast<float>(w + 1);
                mean = fmaf(d, f, mean);
                m2 = (m2 + b[2 * w + 1]) + d * d * (n * static_cast<float>(w) * f);
            }
        }
    }
};

// Layout choices of the register kernel, per launch shape in the launch table (NormTune::layout; the bits
// kLayout* are defined in common.cuh), passed to the kernel as one bit set:
// * kLayoutGammaEarly: gamma/beta are loaded together with the row, so their latency overlaps the loads and
//   the reductions (faster for short rows, where that latency is on every row's critical path; for rows of
//   16-32 elements a thread the extra live registers cost more than they save);
// * kLayoutMerged: LayerNorm statistics of fully covered rows come from one merged (mean, M2) reduction
//   (RowReducer::mean_m2) instead of a reduction of the sum and then one of the squared deviations.
// * kLayoutOnePass: each block normalizes its RPB rows and exits, without the grid-stride loop's bookkeeping
//   (the launch covers every row; a grid that would exceed the launch limit takes the looped instance).

// Registers of one row of the fast path for one thread: its packs of x (and of skip for SkipLayerNorm).
template <typename T, NormKind KIND, int VEC, int VPT>
struct RowRegs {
    Pack<T, VEC> x[VPT];
    Pack<T, VEC> s[has_skip(KIND) ? VPT : 1];
};

// Whether pack k of thread t lies inside the row. FULL: the launch shape covers the row exactly
// (hidden == TPR * VPT * VEC, as at 768, 1024, 4096, 8192), so every pack does and no test is compiled.
template <bool FULL, int TPR>
__device__ __forceinline__ bool pack_in_row(int t, int k, int nvec) {
    return FULL || t + k * TPR < nvec;
}

// Loads thread t's packs of `row` (zeros past the end of the row). A row past the end of the matrix (in the
// last block) loads the last row instead, so the loads need no test of their own; nothing of it is stored.
template <typename T, NormKind KIND, int VEC, int VPT, int TPR, int HINTS, bool FULL>
__device__ __forceinline__ void load_row(RowRegs<T, KIND, VEC, VPT>& r, const NormArgs<T>& a, int64_t row, int t,
                                         int nvec) {
    const int64_t src = (row < a.rows ? row : a.rows - 1) * a.hidden + static_cast<int64_t>(t) * VEC;
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        r.x[k] = pack_in_row<FULL, TPR>(t, k, nvec) ? load_stream<T, VEC, HINTS>(a.x + src + k * TPR * VEC)
                                                    : zero_pack<T, VEC>();
    }
    if constexpr (has_skip(KIND)) {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            r.s[k] = pack_in_row<FULL, TPR>(t, k, nvec) ? load_stream<T, VEC, HINTS>(a.skip + src + k * TPR * VEC)
                                                        : zero_pack<T, VEC>();
        }
    }
}

// Normalizes a loaded row and stores it (and SkipLayerNorm's sum). Every thread of the block calls it, rows
// past the end included, so the barriers inside the reducer are reached by all. Packs outside the row hold
// zeros, which add nothing to the sum; their squared deviations are left out explicitly.
template <typename T, NormKind KIND, int VEC, int VPT, int TPR, int RPB, int HINTS, int LAYOUT, bool FULL,
          bool HAS_BETA>
__device__ __forceinline__ void finish_row(RowRegs<T, KIND, VEC, VPT>& r, const NormArgs<T>& a, int64_t row,
                                           int row_in_block, int t, int nvec, RowReducer<TPR, RPB>& reducer) {
    const bool row_ok = row < a.rows;
    const int64_t off = row * a.hidden + static_cast<int64_t>(t) * VEC;
    float v[VPT][VEC];
#pragma unroll
    for (int k = 0; k < VPT; ++k) unpack_f32<T, VEC>(r.x[k], v[k]);

    if constexpr (has_skip(KIND)) {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            float s[VEC];
            float b[VEC] = {};
            unpack_f32<T, VEC>(r.s[k], s);
            if (a.bias != nullptr && pack_in_row<FULL, TPR>(t, k, nvec)) {
                unpack_f32<T, VEC>(load_pack<T, VEC>(a.bias + (t + k * TPR) * VEC), b);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) v[k][j] = v[k][j] + s[j] + b[j];
            const Pack<T, VEC> rounded = pack_from_f32<T, VEC>(v[k]);  // the sum is rounded to T, as unfused
            unpack_f32<T, VEC>(rounded, v[k]);
            if (a.sum_out != nullptr && row_ok && pack_in_row<FULL, TPR>(t, k, nvec)) {
                store_stream<T, VEC, HINTS>(a.sum_out + off + k * TPR * VEC, rounded);
            }
        }
    }

    // gamma (and beta) of this thread's columns: loaded with the row (kLayoutGammaEarly) or once the
    // statistics are known.
    Pack<T, VEC> gp[VPT];
    Pack<T, VEC> bp[HAS_BETA ? VPT : 1];
    auto load_affine = [&]() {
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            const int c = t + k * TPR;
            gp[k] = pack_in_row<FULL, TPR>(t, k, nvec) ? load_pack<T, VEC>(a.gamma + c * VEC) : zero_pack<T, VEC>();
            if constexpr (HAS_BETA) {
                bp[k] = pack_in_row<FULL, TPR>(t, k, nvec) ? load_pack<T, VEC>(a.beta + c * VEC) : zero_pack<T, VEC>();
            }
        }
    };
    if constexpr ((LAYOUT & kLayoutGammaEarly) != 0) load_affine();

    // One chain per pack below: shorter dependency chains than one running sum.
    float mean = 0.f;
    float rstd;
    if constexpr (centered(KIND) && FULL && (LAYOUT & kLayoutMerged) != 0) {
        constexpr float kInvN = 1.f / static_cast<float>(VPT * VEC);
        float part[VPT];
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            part[k] = 0.f;
#pragma unroll
            for (int j = 0; j < VEC; ++j) part[k] += v[k][j];
        }
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) sum += part[k];
        mean = sum * kInvN;
#pragma unroll
        for (int k = 0; k < VPT; ++k) {
            part[k] = 0.f;
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float d = v[k][j] - mean;
                part[k] = fmaf(d, d, part[k]);
            }
        }
        float m2 = 0.f;
#pragma unroll
        for (int k = 0; k < VPT; ++k) m2 += part[k];
        reducer.mean_m2(mean, m2, static_cast<float>(VPT * VEC), row_in_block, t);
        rstd = rsqrtf(m2 * a.inv_hidden + a.eps);
    } else {
        if constexpr (centered(KIND)) {
            float part[VPT];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                part[k] = 0.f;
#pragma unroll
                for (int j = 0; j < VEC; ++j) part[k] += v[k][j];
            }
            float sum = 0.f;
#pragma unroll
            for (int k = 0; k < VPT; ++k) sum += part[k];
            mean = reducer.sum(sum, row_in_block, t) * a.inv_hidden;
        }
        float sq = 0.f;
        {
            float part[VPT];
#pragma unroll
            for (int k = 0; k < VPT; ++k) {
                part[k] = 0.f;
                if (pack_in_row<FULL, TPR>(t, k, nvec)) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) {
                        const float d = v[k][j] - mean;
                        part[k] = fmaf(d, d, part[k]);
                    }
                }
            }
#pragma unroll
            for (int k = 0; k < VPT; ++k) sq += part[k];
        }
        rstd = rsqrtf(reducer.sum(sq, row_in_block, t) * a.inv_hidden + a.eps);
    }

    if (!row_ok) return;
    if constexpr ((LAYOUT & kLayoutGammaEarly) == 0) load_affine();
#pragma unroll
    for (int k = 0; k < VPT; ++k) {
        if (pack_in_row<FULL, TPR>(t, k, nvec)) {
            float g[VEC];
            unpack_f32<T, VEC>(gp[k], g);
            float f[VEC];
            if constexpr (HAS_BETA) {
                float b[VEC];
                unpack_f32<T, VEC>(bp[k], b);
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = fmaf((v[k][j] - mean) * rstd, g[j], b[j]);
            } else {
#pragma unroll
                for (int j = 0; j < VEC; ++j) f[j] = (v[k][j] - mean) * rstd * g[j];
            }
            store_stream<T, VEC, HINTS>(a.y + off + k * TPR * VEC, pack_from_f32<T, VEC>(f));
        }
    }
}

// Fast path. Block = TPR * RPB threads; thread t of a row group holds packs t, t + TPR, ... of the row.
// All threads of a block run the same number of loop iterations (rows past the end just skip their
// loads and stores) so that the barriers inside RowReducer are reached by everyone.
// HINTS: cache qualifiers of the activations (see load_stream); MINB: resident blocks per SM the register
// allocation must allow (__launch_bounds__; 0 leaves ptxas its default, which is not the same as 1: with an
// explicit 1 it takes more registers). FULL: hidden == TPR * VPT * VEC, so no per-pack bounds tests (a
// separate instance, so that the general one's registers do not weigh on it). HAS_BETA: LayerNorm and
// SkipLayerNorm with a beta (an instance without one has no test and no zeros for it).
template <typename T, NormKind KIND, int VEC, int VPT, int TPR, int RPB, int HINTS, int LAYOUT, int MINB,
          bool FULL, bool HAS_BETA>
__global__ void __launch_bounds__(TPR * RPB, MINB) norm_register_kernel(const NormArgs<T> a) {
    __shared__ float red[RowReducer<TPR, RPB>::kFloats];
    RowReducer<TPR, RPB> reducer{red, 0};
    pdl_trigger();
    pdl_wait();

    const int row_in_block = static_cast<int>(threadIdx.x) / TPR;
    const int t = static_cast<int>(threadIdx.x) % TPR;
    const int nvec = a.hidden / VEC;
    if constexpr ((LAYOUT & kLayoutOnePass) != 0) {
        const int64_t base = static_cast<int64_t>(blockIdx.x) * RPB;
        RowRegs<T, KIND, VEC, VPT> cur;
        load_row<T, KIND, VEC, VPT, TPR, HINTS, FULL>(cur, a, base + row_in_block, t, nvec);
        finish_row<T, KIND, VEC, VPT, TPR, RPB, HINTS, LAYOUT, FULL, HAS_BETA>(cur, a, base + row_in_block, row_in_block,
                                                                       t, nvec, reducer);
        return;
    }
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * RPB; base < a.rows;
         base += static_cast<int64_t>(gridDim.x) * RPB) {
        RowRegs<T, KIND, VEC, VPT> cur;
        load_row<T, KIND, VEC, VPT, TPR, HINTS, FULL>(cur, a, base + row_in_block, t, nvec);
        finish_row<T, KIND, VEC, VPT, TPR, RPB, HINTS, LAYOUT, FULL, HAS_BETA>(cur, a, base + row_in_block, row_in_block,
                                                                       t, nvec, reducer);
    }
}

// Generic path: one warp per row (row_threads == 32, several rows per block) or one block per row
// (row_threads == blockDim.x, a multiple of 32). With CACHE the row's fp32 values are kept in dynamic
// shared memory ([rows per block][hidden]) so HBM is read once; without it each phase re-reads the row.
template <typename T, NormKind KIND, bool CACHE>
__global__ void __launch_bounds__(1024) norm_generic_kernel(const NormArgs<T> a, int row_threads) {
    extern __shared__ float row_cache[];
    __shared__ float red[2 * 32];

    const int rows_per_block = static_cast<int>(blockDim.x) / row_threads;
    const int row_in_block = static_cast<int>(threadIdx.x) / row_threads;
    const int t = static_cast<int>(threadIdx.x) % row_threads;
    const int warps_per_row = row_threads / 32;
    float* cache = row_cache + (CACHE ? static_cast<int64_t>(row_in_block) * a.hidden : 0);
    int parity = 0;
    pdl_trigger();
    pdl_wait();

    auto row_sum = [&](float v) {
        v = warp_allreduce_sum(v);
        if (warps_per_row > 1) {  // only with one row per block
            float* b = red + parity * 32;
            parity ^= 1;
            if ((threadIdx.x & 31) == 0) b[t / 32] = v;
            __syncthreads();
            v = 0.f;
            for (int i = 0; i < warps_per_row; ++i) v += b[i];
        }
        return v;
    };
    // Value of column c that gets normalized, as fp32: x, or x + skip (+ bias) rounded to T.
    auto element = [&](int64_t off, int c) {
        float v = to_f32(a.x[off + c]);
        if constexpr (has_skip(KIND)) {
            const float b = a.bias != nullptr ? to_f32(a.bias[c]) : 0.f;
            v = to_f32(from_f32<T>(v + to_f32(a.skip[off + c]) + b));
        }
        return v;
    };

    for (int64_t base = static_cast<int64_t>(blockIdx.x) * rows_per_block; base < a.rows;
         base += static_cast<int64_t>(gridDim.x) * rows_per_block) {
        const int64_t row = base + row_in_block;
        const bool row_ok = row < a.rows;
        const int64_t off = row * a.hidden;

        // Phase 1: sum (LayerNorm) or sum of squares (RMSNorm); fill the cache and the optional sum output.
        float acc = 0.f;
        if (row_ok) {
            for (int c = t; c < a.hidden; c += row_threads) {
                const float v = element(off, c);
                if constexpr (has_skip(KIND)) {
                    if (a.sum_out != nullptr) a.sum_out[off + c] = from_f32<T>(v);
                }
                if constexpr (CACHE) cache[c] = v;
                acc = centered(KIND) ? acc + v : fmaf(v, v, acc);
            }
        }
        float mean = 0.f;
        float sq = acc;
        if constexpr (centered(KIND)) {
            mean = row_sum(acc) * a.inv_hidden;
            // Phase 2: squared deviations from the mean.
            sq = 0.f;
            if (row_ok) {
                for (int c = t; c < a.hidden; c += row_threads) {
                    const float d = (CACHE ? cache[c] : element(off, c)) - mean;
                    sq = fmaf(d, d, sq);
                }
            }
        }
        const float rstd = rsqrtf(row_sum(sq) * a.inv_hidden + a.eps);

        // Phase 3: normalize, scale, shift.
        if (row_ok) {
            const bool has_beta = centered(KIND) && a.beta != nullptr;
            for (int c = t; c < a.hidden; c += row_threads) {
                const float n = ((CACHE ? cache[c] : element(off, c)) - mean) * rstd;
                const float b = has_beta ? to_f32(a.beta[c]) : 0.f;
                a.y[off + c] = from_f32<T>(fmaf(n, to_f32(a.gamma[c]), b));
            }
        }
    }
}

// The instances of one launch shape, coverage and layout: with or without beta.
template <typename T, NormKind KIND, int VPT, int TPR, int RPB, int HINTS, int LAYOUT, int MINB, bool FULL>
int launch_register_layout(const NormArgs<T>& a, dim3 grid, cudaStream_t stream) {
    constexpr int kVec = kVec16<T>;
    const dim3 block(TPR * RPB);
    if constexpr (centered(KIND)) {
        if (a.beta != nullptr) {
            return launch_kernel(norm_register_kernel<T, KIND, kVec, VPT, TPR, RPB, HINTS, LAYOUT, MINB, FULL, true>,
                                 grid, block, 0, stream, a);
        }
    }
    return launch_kernel(norm_register_kernel<T, KIND, kVec, VPT, TPR, RPB, HINTS, LAYOUT, MINB, FULL, false>, grid,
                         block, 0, stream, a);
}

// Register budget of the fast path: the most row elements one thread keeps. Fewer elements per thread mean
// more threads per row, more resident warps and shorter-lived blocks; more mean more 16-byte loads in flight
// per thread and fewer barriers per row. Measured on an H200 (8/16/32 for each op and dtype at 16384x768 ..
// 4096x8192): 16 is best or within noise of best for fp32 and for SkipLayerNorm / SkipRMSNorm (two input
// streams), 32 for fp16/bf16 LayerNorm and RMSNorm, whose 16-element version needs twice the threads and
// barriers per row (0.84 instead of 0.93 of copy bandwidth at 16384x4096 fp16).
template <typename T, NormKind KIND>
constexpr int kNormMaxElems = (sizeof(T) == 4 || has_skip(KIND)) ? 16 : 32;

template <typename T, NormKind KIND>
constexpr int kNormMaxVpt = kNormMaxElems<T, KIND> / kVec16<T> > 0 ? kNormMaxElems<T, KIND> / kVec16<T> : 1;

static_assert(kNormMaxVpt<float, NormKind::kLayerNorm> <= 8 && kNormMaxVpt<__half, NormKind::kLayerNorm> <= 8,
              "at most 8 packs per thread are instantiated");

// Packs per thread that have a kernel instance; a request for v packs takes the smallest choice >= v.
constexpr int kVptChoices[] = {1, 2, 3, 4, 6, 8};
constexpr int kNumVptChoices = static_cast<int>(sizeof(kVptChoices) / sizeof(kVptChoices[0]));

// Whether (TPR threads per row, VPT packs per thread) has an instance: any VPT for TPR == 4, otherwise more
// than half the budget MAXV (a group half as large was too small), and at most 16 elements per thread with
// 1024 threads (the 64-register cap of a 1024-thread block spills beyond that).
constexpr bool vpt_usable(int vpt, int maxv, int tpr, int vec) {
    return vpt <= maxv && (tpr == 4 || 2 * vpt > maxv) && (tpr < 1024 || vpt * vec <= 16);
}

// The launch shape the dispatch below picks for an aligned row of `hidden` elements: the fewest threads per
// row (4, 8, ..., 1024) that hold it within the budget, then the smallest usable VPT; {0, 0} when the row
// takes the generic kernel. The same rules as launch_with_tpr / launch_with_vpt, for the launch table.
struct NormShape {
    int tpr, vpt;
};

template <typename T, NormKind KIND>
constexpr NormShape norm_shape(int hidden) {
    constexpr int kVec = kVec16<T>;
    constexpr int kMaxV = kNormMaxVpt<T, KIND>;
    if (hidden < 1 || hidden % kVec != 0) return {0, 0};
    const int nvec = hidden / kVec;
    int tpr = 4;
    while (tpr <= 1024 && nvec > tpr * kMaxV) tpr *= 2;
    if (tpr > 1024) return {0, 0};
    const int need = (nvec + tpr - 1) / tpr;
    for (int i = 0; i < kNumVptChoices; ++i) {
        if (vpt_usable(kVptChoices[i], kMaxV, tpr, kVec) && need <= kVptChoices[i]) return {tpr, kVptChoices[i]};
    }
    return {0, 0};
}

// The launch choices of one (dtype, op, launch shape, coverage) on architecture ARCH (launch_table.cuh): the
// sm_90 row whose row size has this shape and coverage, else kNormDefault.
template <typename T, NormKind KIND, int TPR, int VPT, bool FULL, int ARCH>
constexpr NormTune norm_launch() {
    if (ARCH == kArchSm90) {
        for (const launch_table::NormRow& r : launch_table::kNormSm90) {
            if (r.dtype != dtype_code<T>() || r.kind != static_cast<int>(KIND)) continue;
            const NormShape s = norm_shape<T, KIND>(r.hidden);
            if (s.tpr == TPR && s.vpt == VPT && (r.hidden == TPR * VPT * kVec16<T>) == FULL) {
                return {r.hints, r.cap, r.block, r.layout};
            }
        }
    }
    return launch_table::kNormDefault;
}

// Compile-time checks of the sm_90 norm rows: a known dtype and op, a row size with a register-kernel launch
// shape, legal values, and no two rows for one shape and coverage.
template <typename T, NormKind KIND>
constexpr bool norm_row_ok(const launch_table::NormRow& r) {
    const NormShape s = norm_shape<T, KIND>(r.hidden);
    return s.tpr > 0 && (r.hints == kHintsNone || r.hints == kHintsStream || r.hints == kHintsL2LastCs) &&
           r.cap >= 0 && r.cap <= 2048 && (r.block == 64 || r.block == 128) &&
           (r.layout & ~(kLayoutGammaEarly | kLayoutMerged | kLayoutOnePass)) == 0;
}

constexpr bool norm_rows_ok() {
    for (const launch_table::NormRow& r : launch_table::kNormSm90) {
        if (r.kind < 0 || r.kind > 3 || r.dtype < 0 || r.dtype > 2) return false;
    }
    return true;
}

template <typename T, NormKind KIND>
constexpr bool norm_rows_ok_for() {
    const auto& rows = launch_table::kNormSm90;
    const int n = static_cast<int>(sizeof(rows) / sizeof(rows[0]));
    for (int i = 0; i < n; ++i) {
        if (rows[i].dtype != dtype_code<T>() || rows[i].kind != static_cast<int>(KIND)) continue;
        if (!norm_row_ok<T, KIND>(rows[i])) return false;
        const NormShape a = norm_shape<T, KIND>(rows[i].hidden);
        const bool full_a = rows[i].hidden == a.tpr * a.vpt * kVec16<T>;
        for (int j = i + 1; j < n; ++j) {
            if (rows[j].dtype != rows[i].dtype || rows[j].kind != rows[i].kind) continue;
            const NormShape b = norm_shape<T, KIND>(rows[j].hidden);
            const bool full_b = rows[j].hidden == b.tpr * b.vpt * kVec16<T>;
            if (a.tpr == b.tpr && a.vpt == b.vpt && full_a == full_b) return false;
        }
    }
    return true;
}

static_assert(norm_rows_ok(), "launch_table.cuh: a norm row with an unknown dtype or op");

template <typename T, NormKind KIND, int VPT, int TPR, bool FULL, int ARCH>
int launch_register_tuned(const NormArgs<T>& a, cudaStream_t stream) {
    static_assert(norm_rows_ok_for<T, KIND>(),
                  "launch_table.cuh: a norm row without a register-kernel shape, with an illegal value, or two rows "
                  "for one launch shape and coverage");
    constexpr NormTune kTune = norm_launch<T, KIND, TPR, VPT, FULL, ARCH>();
    constexpr int kBlock = kTune.block > 0 ? kTune.block : 128;
    constexpr int kRpb = TPR >= kBlock ? 1 : kBlock / TPR;  // small rows: several per block
    constexpr int kMinBlocks = kTune.min_threads / (TPR * kRpb) < 1    ? 0
                               : kTune.min_threads / (TPR * kRpb) > 32 ? 32
                                                                       : kTune.min_threads / (TPR * kRpb);
    constexpr int kLayout = kTune.layout;
    const dim3 grid(grid_for(a.rows, kRpb));
    if constexpr ((kLayout & kLayoutOnePass) != 0) {
        if (static_cast<int64_t>(grid.x) * kRpb < a.rows) {  // the grid was capped: only the loop covers every row
            return launch_register_layout<T, KIND, VPT, TPR, kRpb, kTune.hints, kLayout & ~kLayoutOnePass, kMinBlocks,
                                          FULL>(a, grid, stream);
        }
    }
    return launch_register_layout<T, KIND, VPT, TPR, kRpb, kTune.hints, kLayout, kMinBlocks, FULL>(a, grid, stream);
}

template <typename T, NormKind KIND, int VPT, int TPR, int ARCH>
int launch_register(const NormArgs<T>& a, cudaStream_t stream) {
    return a.hidden == TPR * VPT * kVec16<T> ? launch_register_tuned<T, KIND, VPT, TPR, true, ARCH>(a, stream)
                                              : launch_register_tuned<T, KIND, VPT, TPR, false, ARCH>(a, stream);
}

// Largest hidden (in elements) the generic path keeps in shared memory with one row per block.
constexpr int kGenericCacheLimit = 48 * 1024 / static_cast<int>(sizeof(float));

template <typename T, NormKind KIND>
int launch_generic(const NormArgs<T>& a, cudaStream_t stream) {
    if (a.hidden <= 1024) {  // one warp per row, four rows per block, row cached
        const size_t smem = 4 * sizeof(float) * static_cast<size_t>(a.hidden);
        return launch_kernel(norm_generic_kernel<T, KIND, true>, dim3(grid_for(a.rows, 4)), dim3(128), smem, stream,
                             a, 32);
    }
    int threads = ((a.hidden + 7) / 8 + 31) / 32 * 32;  // about 8 elements per thread
    threads = threads < 128 ? 128 : (threads > 1024 ? 1024 : threads);
    if (a.hidden <= kGenericCacheLimit) {
        const size_t smem = sizeof(float) * static_cast<size_t>(a.hidden);
        return launch_kernel(norm_generic_kernel<T, KIND, true>, dim3(grid_for(a.rows, 1)), dim3(threads), smem,
                             stream, a, threads);
    }
    return launch_kernel(norm_generic_kernel<T, KIND, false>, dim3(grid_for(a.rows, 1)), dim3(threads), 0, stream, a,
                         threads);
}

// Launches the register kernel with TPR threads per row and the smallest instantiated VPT >= v (see
// vpt_usable: only the VPTs the dispatch can ask for are instantiated).
template <typename T, NormKind KIND, int MAXV, int TPR, int ARCH, int I = 0>
int launch_with_vpt(const NormArgs<T>& a, int v, cudaStream_t stream) {
    if constexpr (I >= kNumVptChoices) {
        return launch_generic<T, KIND>(a, stream);
    } else {
        constexpr int kVpt = kVptChoices[I];
        if constexpr (vpt_usable(kVpt, MAXV, TPR, kVec16<T>)) {
            if (v <= kVpt) return launch_register<T, KIND, kVpt, TPR, ARCH>(a, stream);
        }
        return launch_with_vpt<T, KIND, MAXV, TPR, ARCH, I + 1>(a, v, stream);
    }
}

// The fewest threads per row (4, 8, ..., 1024) that hold the row within the register budget.
template <typename T, NormKind KIND, int MAXV, int ARCH, int TPR = 4>
int launch_with_tpr(const NormArgs<T>& a, int nvec, cudaStream_t stream) {
    if constexpr (TPR > 1024) {
        return launch_generic<T, KIND>(a, stream);
    } else {
        if (nvec <= TPR * MAXV) return launch_with_vpt<T, KIND, MAXV, TPR, ARCH>(a, (nvec + TPR - 1) / TPR, stream);
        return launch_with_tpr<T, KIND, MAXV, ARCH, TPR * 2>(a, nvec, stream);
    }
}

// Picks the kernel for a validated argument set: the register path when hidden is a whole number of
// 16-byte packs and every pointer is 16-byte aligned (rows up to 1024 threads x the budget), else generic;
// the register path's launch choices are those of the device's architecture (launch_table.cuh).
template <typename T, NormKind KIND>
int launch_norm(const NormArgs<T>& a, cudaStream_t stream) {
    constexpr int kVec = kVec16<T>;
    constexpr int kMaxV = kNormMaxVpt<T, KIND>;
    const bool vector_ok = a.hidden % kVec == 0 && aligned16(a.x) && aligned16(a.skip) && aligned16(a.bias) &&
                           aligned16(a.gamma) && aligned16(a.beta) && aligned16(a.y) && aligned16(a.sum_out);
    if (!vector_ok) return launch_generic<T, KIND>(a, stream);
    const int nvec = a.hidden / kVec;
    return table_arch() == kArchSm90 ? launch_with_tpr<T, KIND, kMaxV, kArchSm90>(a, nvec, stream)
                                     : launch_with_tpr<T, KIND, kMaxV, kArchDefault>(a, nvec, stream);
}

// Argument checks shared by the C entry points; returns MOGRAPH_OK or an error status.
inline int check_norm_args(const void* x, const void* gamma, const void* y, int64_t rows, int64_t hidden,
                           uint32_t flags) {
    if (flags != 0 || rows < 0 || hidden < 0) return MOGRAPH_ERR_INVALID_ARGUMENT;
    if (rows == 0) return MOGRAPH_OK;
    if (hidden < 1 || x == nullptr || gamma == nullptr || y == nullptr) return MOGRAPH_ERR_INVALID_ARGUMENT;
    if (hidden > 0x7fffffff) return MOGRAPH_ERR_UNSUPPORTED;
    return MOGRAPH_OK;
}

template <typename T>
NormArgs<T> make_norm_args(const void* x, const void* skip, const void* bias, const void* gamma, const void* beta,
                           void* y, void* sum_out, int64_t rows, int64_t hidden, float eps) {
    NormArgs<T> a;
    a.x = static_cast<const T*>(x);
    a.skip = static_cast<const T*>(skip);
    a.bias = static_cast<const T*>(bias);
    a.gamma = static_cast<const T*>(gamma);
    a.beta = static_cast<const T*>(beta);
    a.y = static_cast<T*>(y);
    a.sum_out = static_cast<T*>(sum_out);
    a.rows = rows;
    a.hidden = static_cast<int>(hidden);
    a.eps = eps;
    a.inv_hidden = 1.0f / static_cast<float>(hidden);
    return a;
}

template <typename T>
int layer_norm(const void* x, const void* gamma, const void* beta, void* y, int64_t rows, int64_t hidden, float eps,
               uint32_t flags, cudaStream_t stream) {
    const int st = check_norm_args(x, gamma, y, rows, hidden, flags);
    if (st != MOGRAPH_OK || rows == 0) return st;
    return launch_norm<T, NormKind::kLayerNorm>(
        make_norm_args<T>(x, nullptr, nullptr, gamma, beta, y, nullptr, rows, hidden, eps), stream);
}

template <typename T>
int rms_norm(const void* x, const void* gamma, void* y, int64_t rows, int64_t hidden, float eps, uint32_t flags,
             cudaStream_t stream) {
    const int st = check_norm_args(x, gamma, y, rows, hidden, flags);
    if (st != MOGRAPH_OK || rows == 0) return st;
    return launch_norm<T, NormKind::kRmsNorm>(
        make_norm_args<T>(x, nullptr, nullptr, gamma, nullptr, y, nullptr, rows, hidden, eps), stream);
}

template <typename T>
int skip_rms_norm(const void* x, const void* skip, const void* bias, const void* gamma, void* y, void* sum_out,
                  int64_t rows, int64_t hidden, float eps, uint32_t flags, cudaStream_t stream) {
    const int st = check_norm_args(x, gamma, y, rows, hidden, flags);
    if (st != MOGRAPH_OK || rows == 0) return st;
    if (skip == nullptr) return MOGRAPH_ERR_INVALID_ARGUMENT;
    return launch_norm<T, NormKind::kSkipRmsNorm>(
        make_norm_args<T>(x, skip, bias, gamma, nullptr, y, sum_out, rows, hidden, eps), stream);
}

template <typename T>
int skip_layer_norm(const void* x, const void* skip, const void* bias, const void* gamma, const void* beta, void* y,
                    void* sum_out, int64_t rows, int64_t hidden, float eps, uint32_t flags, cudaStream_t stream) {
    const int st = check_norm_args(x, gamma, y, rows, hidden, flags);
    if (st != MOGRAPH_OK || rows == 0) return st;
    if (skip == nullptr) return MOGRAPH_ERR_INVALID_ARGUMENT;
    return launch_norm<T, NormKind::kSkipLayerNorm>(
        make_norm_args<T>(x, skip, bias, gamma, beta, y, sum_out, rows, hidden, eps), stream);
}

}  // namespace mograph
