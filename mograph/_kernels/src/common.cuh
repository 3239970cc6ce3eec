// common.cuh - building blocks shared by mograph's kernels: dtype conversions, 16-byte packs,
// warp/row reductions and the argument checks every C entry point makes.
//
// Why packs: the kernels are bound by memory bandwidth, and a 16-byte access per thread (LDG.E.128 /
// STG.E.128) moves the most bytes per instruction. A Pack<T, N> is N elements of T that travel as one
// access when N * sizeof(T) is 16 (or 8, 4, 2); N = 1 is the scalar fallback for sizes or pointers that
// are not aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "mograph_kernels.h"

namespace mograph {

// ---- dtype conversions: fp32 is the compute type of every op --------------------------------------------
template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Elements of T in one 16-byte access.
template <typename T>
constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

// ---- packs -----------------------------------------------------------------------------------------------
template <int BYTES>
struct RawOf;
template <>
struct RawOf<16> { using type = uint4; };
template <>
struct RawOf<8> { using type = uint2; };
template <>
struct RawOf<4> { using type = unsigned int; };
template <>
struct RawOf<2> { using type = unsigned short; };

// The N elements are held as one raw word (uint4 for 16 bytes), never as N separate values: a select or a
// copy of a pack then moves whole 32-bit registers, where an array of 16-bit halves would be split by the
// compiler into one register per half and re-assembled with a PRMT per element. unpack_f32 / pack_from_f32
// convert between a pack and fp32 values.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
    using Raw = typename RawOf<sizeof(T) * N>::type;
    Raw w;
};

// Element j of a pack (the Gelu kernels convert element by element).
template <typename T, int N>
__device__ __forceinline__ T pack_elem(const Pack<T, N>& p, int j) {
    return reinterpret_cast<const T*>(&p.w)[j];
}

// One access of N elements starting at p (p must be aligned to sizeof(T) * N). Read-only data path.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> load_pack(const T* p) {
    using Raw = typename Pack<T, N>::Raw;
    Pack<T, N> out;
    out.w = __ldg(reinterpret_cast<const Raw*>(p));
    return out;
}

template <typename T, int N>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, N>& v) {
    using Raw = typename Pack<T, N>::Raw;
    *reinterpret_cast<Raw*>(p) = v.w;
}

// Accesses to data touched once (activations), as opposed to gamma/beta/bias that every row re-reads.
// HINTS selects the cache qualifiers (a template parameter, so each kernel instance picks its own; the
// launch table, launch_table.cuh, chooses per op and size from H200 measurements):
//   kHintsNone     (0): plain accesses (loads through the read-only path, ld.global.nc);
//   kHintsStream   (1): loads and stores evict-first (ld/st.global.cs), so the reused vectors stay cached;
//   kHintsL2LastCs (2): 16-byte loads marked L1::evict_last with an L2 evict_last access policy (what Triton
//                       emits for Inductor's reductions at eviction_policy='evict_last'), evict-first stores.
constexpr int kHintsNone = 0;
constexpr int kHintsStream = 1;
constexpr int kHintsL2LastCs = 2;

template <typename T, int N, int HINTS = kHintsStream>
__device__ __forceinline__ Pack<T, N> load_stream(const T* p) {
    if constexpr (HINTS == kHintsL2LastCs && sizeof(T) * N == 16) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        Pack<T, N> out;
        uint64_t policy;
        asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
        asm volatile("ld.global.L1::evict_last.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(out.w.x), "=r"(out.w.y), "=r"(out.w.z), "=r"(out.w.w)
                     : "l"(p), "l"(policy));
        return out;
#endif
    }
    if constexpr (HINTS == kHintsStream) {
        using Raw = typename Pack<T, N>::Raw;
        Pack<T, N> out;
        out.w = __ldcs(reinterpret_cast<const Raw*>(p));
        return out;
    }
    return load_pack<T, N>(p);
}

template <typename T, int N, int HINTS = kHintsStream>
__device__ __forceinline__ void store_stream(T* p, const Pack<T, N>& v) {
    if constexpr (HINTS == kHintsStream || HINTS == kHintsL2LastCs) {
        using Raw = typename Pack<T, N>::Raw;
        __stcs(reinterpret_cast<Raw*>(p), v.w);
        return;
    }
    store_pack<T, N>(p, v);
}

// ---- launch choices -----------------------------------------------------------------------------------------
// Per launch shape and architecture; the values live in launch_table.cuh (see norm.cuh and gelu.cuh for their use).
// Layout choices of the norm register kernel (NormTune::layout, bits):
// * kLayoutGammaEarly: gamma/beta are loaded together with the row, so their latency overlaps the loads and
//   the reductions instead of following them (costs registers: slower where a thread keeps 32 elements);
// * kLayoutMerged: LayerNorm statistics of fully covered rows come from one merged (mean, M2) reduction
//   instead of two (see RowReducer::mean_m2);
// * kLayoutOnePass: each block normalizes its RPB rows and exits, without the grid-stride loop's bookkeeping
//   (taken only when the grid covers every row).
constexpr int kLayoutGammaEarly = 1;
constexpr int kLayoutMerged = 2;
constexpr int kLayoutOnePass = 4;

struct NormTune {
    int hints;        // kHints* for the activations
    int min_threads;  // resident threads per SM the register allocation must allow (0: no cap)
    int block;        // threads per block when rows are smaller (several rows per block): 64 or 128
    int layout;       // kLayout* bits
};

struct GeluTune {
    int hints;        // kHints* for x and y
    int min_threads;  // as for NormTune
    int group;        // blocks per group (1: contiguous chunks; see gelu_kernel and bias_gelu_kernel)
};

// Codes of the dtypes in the tables: 0 fp32, 1 fp16, 2 bf16.
template <typename T>
constexpr int dtype_code() {
    return std::is_same<T, float>::value ? 0 : (std::is_same<T, __half>::value ? 1 : 2);
}

// ---- programmatic dependent launch (Hopper) -----------------------------------------------------------------
// Kernels are launched with programmatic stream serialization where the device supports it (sm_90+), so the
// next kernel in the stream can be scheduled onto SMs while this one drains its last blocks, instead of
// after it has completed. Correctness: every kernel calls pdl_wait() before its first global memory access;
// griddepcontrol.wait returns once the previous grid in the stream has completed and its writes are visible
// (immediately when the launch had no programmatic dependency). pdl_trigger() lets the next grid launch
// (once every block of this grid has triggered or exited); it does not make this grid's writes visible early.
// Both are no-ops on older architectures. MOGRAPH_NO_PDL launches plainly (cudaLaunchKernelEx without the
// attribute) and compiles both out.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(MOGRAPH_NO_PDL)
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(MOGRAPH_NO_PDL)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A pack of zeros (+0 is all-zero bits in fp32, fp16 and bf16), set as raw words: no conversions.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> zero_pack() {
    Pack<T, N> out;
    out.w = typename Pack<T, N>::Raw{};
    return out;
}

// The N elements of a pack as fp32. fp16/bf16 pairs are converted as one 32-bit word each (__half22float2 /
// __bfloat1622float2: one conversion instruction per element reading either half of the word in place),
// not element by element, which would first move each half into a register of its own (PRMT).
template <typename T, int N>
__device__ __forceinline__ void unpack_f32(const Pack<T, N>& p, float (&f)[N]) {
    if constexpr (std::is_same<T, __half>::value && N % 2 == 0) {
        const __half2* w = reinterpret_cast<const __half2*>(&p.w);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            const float2 v = __half22float2(w[j]);
            f[2 * j] = v.x;
            f[2 * j + 1] = v.y;
        }
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value && N % 2 == 0) {
        const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(&p.w);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) {
            const float2 v = __bfloat1622float2(w[j]);
            f[2 * j] = v.x;
            f[2 * j + 1] = v.y;
        }
    } else {
        const T* e = reinterpret_cast<const T*>(&p.w);
#pragma unroll
        for (int j = 0; j < N; ++j) f[j] = to_f32(e[j]);
    }
}

// Rounds N fp32 values into a pack; fp16/bf16 pairs go through one packed conversion (F2FP) per two, written
// as whole words.
template <typename T, int N>
__device__ __forceinline__ Pack<T, N> pack_from_f32(const float (&f)[N]) {
    Pack<T, N> out;
    if constexpr (std::is_same<T, __half>::value && N % 2 == 0) {
        __half2* w = reinterpret_cast<__half2*>(&out.w);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) w[j] = __floats2half2_rn(f[2 * j], f[2 * j + 1]);
    } else if constexpr (std::is_same<T, __nv_bfloat16>::value && N % 2 == 0) {
        __nv_bfloat162* w = reinterpret_cast<__nv_bfloat162*>(&out.w);
#pragma unroll
        for (int j = 0; j < N / 2; ++j) w[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    } else {
        T* e = reinterpret_cast<T*>(&out.w);
#pragma unroll
        for (int j = 0; j < N; ++j) e[j] = from_f32<T>(f[j]);
    }
    return out;
}

// ---- reductions -------------------------------------------------------------------------------------------
// Butterfly sum over the 32 lanes of a warp; every lane gets the same (bit-identical) total.
__device__ __forceinline__ float warp_allreduce_sum(float v) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
    return v;
}

// ---- host-side helpers -------------------------------------------------------------------------------------
inline bool aligned16(const void* p) { return p == nullptr || (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Turns the result of a launch into a status code. cudaGetLastError also clears a launch error, so the
// next call does not report it again.
inline int launch_status() {
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? MOGRAPH_OK : MOGRAPH_ERR_CUDA_BASE + static_cast<int>(err);
}

// Grid size for `work` items with `per_block` items per block, capped at the largest x dimension; the
// kernels loop when the cap bites.
inline unsigned int grid_for(int64_t work, int64_t per_block) {
    int64_t blocks = (work + per_block - 1) / per_block;
    const int64_t cap = 0x7fffffff;
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    return static_cast<unsigned int>(blocks);
}

// Facts about the current device that launch decisions need, read once per device and cached (the calls are
// cheap but not free, and a launch should cost as little host time as possible). Queries only: the current
// device is not changed, nothing is synchronized.
struct DeviceFacts {
    int sms = 0;        // multiprocessors
    int cc_major = 0;   // compute capability major
};

inline DeviceFacts device_facts() {
    constexpr int kMaxDevices = 64;
    static std::atomic<int> sms_cache[kMaxDevices];    // 0 = not read yet
    static std::atomic<int> major_cache[kMaxDevices];
    DeviceFacts f;
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        f.sms = 132;
        return f;
    }
    if (dev >= 0 && dev < kMaxDevices) {
        f.sms = sms_cache[dev].load(std::memory_order_acquire);
        f.cc_major = major_cache[dev].load(std::memory_order_relaxed);
        if (f.sms > 0) return f;
    }
    if (cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&f.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        f.sms = 132;
        f.cc_major = 0;
        return f;
    }
    if (dev >= 0 && dev < kMaxDevices) {
        major_cache[dev].store(f.cc_major, std::memory_order_relaxed);
        sms_cache[dev].store(f.sms, std::memory_order_release);
    }
    return f;
}

// Enqueues kernel<<<grid, block, smem, stream>>>(args...) with programmatic stream serialization on sm_90+
// (see pdl_wait), plainly elsewhere or with MOGRAPH_NO_PDL; returns the launch status.
template <typename... KArgs, typename... Args>
int launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                  const Args&... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
#ifdef MOGRAPH_NO_PDL
    cfg.numAttrs = 0;
#else
    cfg.numAttrs = device_facts().cc_major >= 9 ? 1 : 0;
#endif
    cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, args...);
    if (err != cudaSuccess && cfg.numAttrs != 0 && err != cudaErrorStreamCaptureInvalidated &&
        err != cudaErrorStreamCaptureUnsupported) {
        (void)cudaGetLastError();  // a stream that refuses the attribute: launch plainly
        cfg.numAttrs = 0;
        err = cudaLaunchKernelEx(&cfg, kernel, args...);
    }
    const int st = launch_status();  // also clears the error it reads
    return err != cudaSuccess ? MOGRAPH_ERR_CUDA_BASE + static_cast<int>(err) : st;
}

}  // namespace mograph
