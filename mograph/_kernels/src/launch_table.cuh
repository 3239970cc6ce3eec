// launch_table.cuh - the kernels' launch choices, per GPU architecture. Frozen: no more tuning.
//
// sm_90 (H100/H200): the choices measured best on an H200 for the four benchmarked row sizes (768, 1024, 4096,
// 8192) of every dtype and norm op, and per dtype and form for Gelu (BENCHMARKS.md has the measurements and the
// history). Every other architecture, and on sm_90 every norm launch shape that no row below sets, takes the
// defaults kNormDefault / kGeluDefault. The architecture is read at launch time (device_facts() in common.cuh,
// cached per device), so one library carries both; the kernels compile every choice in, nothing is generated.
//
// A norm row names the row size whose launch shape it sets: the dispatch in norm.cuh derives the register
// kernel's launch shape (threads per row x 16-byte packs per thread, the trailing comment) from the dtype, op and
// hidden, and the row applies to every hidden of that shape and coverage. Coverage matters: a row the shape
// covers exactly (768 in 64x3 for fp32) runs an instance without bounds tests, a row it covers in part (768 in
// 64x2 for fp16 SkipLayerNorm, the shape of 1024) another one; two rows may not set the same shape and coverage
// (norm.cuh checks this at compile time, together with the value ranges).
//
// Columns: hints (cache qualifiers of the activations, see load_stream: kL2LastCs = evict_last loads with
// evict-first stores, what Triton emits; kStream = evict-first loads and stores; kPlain), cap (resident threads
// per SM the register allocation must allow, __launch_bounds__; 0 = none), block (threads per block of rows
// that share blocks: 64 or 128), layout (kGammaEarly: gamma/beta loaded with the row; kMerged: LayerNorm's mean
// and M2 in one merged reduction; kOnePass: no grid-stride loop, see norm.cuh).
#pragma once

#include "common.cuh"

namespace mograph {
namespace launch_table {

constexpr int kF32 = 0, kF16 = 1, kBf16 = 2;                  // dtype_code<T>()
constexpr int kLN = 0, kRMS = 1, kSkipLN = 2, kSkipRMS = 3;   // NormKind
constexpr int kPlain = kHintsNone, kStream = kHintsStream, kL2LastCs = kHintsL2LastCs;
constexpr int kGammaEarly = kLayoutGammaEarly, kMerged = kLayoutMerged, kOnePass = kLayoutOnePass;

struct NormRow {
    int dtype, kind, hidden, hints, cap, block, layout;
};

// Norm launch shapes that no row sets, on sm_90 and everywhere else: evict_last loads with evict-first stores,
// no register cap, 128-thread blocks, one pass (on an H200 5.5% less time in geometric mean over 16 sizes
// outside the table than the choices before them; BENCHMARKS.md).
constexpr NormTune kNormDefault = {kL2LastCs, 0, 128, kOnePass};

constexpr NormRow kNormSm90[] = {
    // dtype  op      hidden  hints    cap  block layout                          // shape
    {kF32,  kLN,       768, kL2LastCs,    0, 128, kGammaEarly | kMerged},                       // 64x3
    {kF32,  kRMS,      768, kStream,      0, 128, kGammaEarly},                                 // 64x3
    {kF32,  kSkipLN,   768, kPlain,    1024,  64, 0},                                           // 64x3
    {kF32,  kSkipRMS,  768, kL2LastCs, 1024,  64, 0},                                           // 64x3
    {kF16,  kLN,       768, kL2LastCs, 1024, 128, kGammaEarly},                                 // 32x3
    {kF16,  kRMS,      768, kL2LastCs, 1280, 128, kGammaEarly},                                 // 32x3
    {kF16,  kSkipLN,   768, kL2LastCs, 1024, 128, 0},                                           // 64x2, in part
    {kF16,  kSkipRMS,  768, kL2LastCs,    0, 128, 0},                                           // 64x2, in part
    {kBf16, kLN,       768, kL2LastCs, 1024, 128, kGammaEarly},                                 // 32x3
    {kBf16, kRMS,      768, kL2LastCs,    0, 128, kGammaEarly},                                 // 32x3
    {kBf16, kSkipLN,   768, kL2LastCs, 1024, 128, 0},                                           // 64x2, in part
    {kBf16, kSkipRMS,  768, kL2LastCs, 1024, 128, 0},                                           // 64x2, in part
    {kF32,  kLN,      1024, kL2LastCs, 1024,  64, 0},                                           // 64x4
    {kF32,  kRMS,     1024, kL2LastCs, 1024,  64, 0},                                           // 64x4
    {kF32,  kSkipLN,  1024, kL2LastCs,    0,  64, kGammaEarly},                                 // 64x4
    {kF32,  kSkipRMS, 1024, kL2LastCs,    0,  64, 0},                                           // 64x4
    {kF16,  kLN,      1024, kL2LastCs,    0, 128, kGammaEarly},                                 // 32x4
    {kF16,  kRMS,     1024, kL2LastCs, 1024,  64, 0},                                           // 32x4
    {kF16,  kSkipLN,  1024, kL2LastCs, 1024, 128, 0},                                           // 64x2
    {kF16,  kSkipRMS, 1024, kL2LastCs,    0, 128, 0},                                           // 64x2
    {kBf16, kLN,      1024, kL2LastCs,    0,  64, kGammaEarly},                                 // 32x4
    {kBf16, kRMS,     1024, kL2LastCs, 1024,  64, 0},                                           // 32x4
    {kBf16, kSkipLN,  1024, kL2LastCs, 1024, 128, 0},                                           // 64x2
    {kBf16, kSkipRMS, 1024, kL2LastCs, 1024, 128, 0},                                           // 64x2
    {kF32,  kLN,      4096, kL2LastCs, 1024, 128, kGammaEarly | kMerged},                       // 256x4
    {kF32,  kRMS,     4096, kL2LastCs,    0, 128, kGammaEarly},                                 // 256x4
    {kF32,  kSkipLN,  4096, kL2LastCs, 1024,  64, 0},                                           // 256x4
    {kF32,  kSkipRMS, 4096, kL2LastCs,    0, 128, kGammaEarly},                                 // 256x4
    {kF16,  kLN,      4096, kL2LastCs,    0, 128, 0},                                           // 128x4
    {kF16,  kRMS,     4096, kL2LastCs,    0, 128, kGammaEarly},                                 // 128x4
    {kF16,  kSkipLN,  4096, kL2LastCs, 1024,  64, kOnePass},                                    // 256x2
    {kF16,  kSkipRMS, 4096, kL2LastCs,    0, 128, 0},                                           // 256x2
    {kBf16, kLN,      4096, kL2LastCs,    0, 128, 0},                                           // 128x4
    {kBf16, kRMS,     4096, kL2LastCs,    0, 128, kGammaEarly},                                 // 128x4
    {kBf16, kSkipLN,  4096, kL2LastCs, 1024,  64, kOnePass},                                    // 256x2
    {kBf16, kSkipRMS, 4096, kL2LastCs, 1536,  64, 0},                                           // 256x2
    {kF32,  kLN,      8192, kL2LastCs,    0, 128, kGammaEarly | kOnePass},                      // 512x4
    {kF32,  kRMS,     8192, kL2LastCs,    0, 128, kGammaEarly},                                 // 512x4
    {kF32,  kSkipLN,  8192, kL2LastCs,    0, 128, kMerged},                                     // 512x4
    {kF32,  kSkipRMS, 8192, kL2LastCs, 1280,  64, 0},                                           // 512x4
    {kF16,  kLN,      8192, kL2LastCs, 1024, 128, kMerged | kOnePass},                          // 256x4
    {kF16,  kRMS,     8192, kL2LastCs,    0, 128, 0},                                           // 256x4
    {kF16,  kSkipLN,  8192, kL2LastCs, 1024, 128, kGammaEarly | kOnePass},                      // 512x2
    {kF16,  kSkipRMS, 8192, kL2LastCs,    0, 128, 0},                                           // 512x2
    {kBf16, kLN,      8192, kL2LastCs, 1024,  64, kGammaEarly | kOnePass},                      // 256x4
    {kBf16, kRMS,     8192, kL2LastCs, 1024,  64, kOnePass},                                    // 256x4
    {kBf16, kSkipLN,  8192, kL2LastCs, 1280,  64, 0},                                           // 512x2
    {kBf16, kSkipRMS, 8192, kL2LastCs,    0, 128, 0},                                           // 512x2
};

// Gelu and BiasGelu, per dtype and form; the tanh BiasGelu takes the exact one's row. {hints, cap, group}: the
// group is GeluTune::group (see gelu_kernel; 1 = one contiguous chunk per block).
struct GeluRow {
    int dtype, op, hints, cap, group;  // op: 0 Gelu, 1 Gelu (tanh), 2 BiasGelu
};

// Other architectures: the choice before any tuning (evict-first accesses, no cap, contiguous chunks).
constexpr GeluTune kGeluDefault = {kStream, 0, 1};

constexpr GeluRow kGeluSm90[] = {
    // dtype  op  hints      cap  group
    {kF32,  0, kL2LastCs, 1024, 4},
    {kF32,  1, kL2LastCs, 1024, 8},
    {kF32,  2, kL2LastCs, 1024, 4},
    {kF16,  0, kL2LastCs,    0, 8},
    {kF16,  1, kL2LastCs, 1024, 4},
    {kF16,  2, kStream,      0, 1},
    {kBf16, 0, kL2LastCs,    0, 8},
    {kBf16, 1, kL2LastCs, 1024, 4},
    {kBf16, 2, kStream,      0, 1},
};

}  // namespace launch_table

// Architectures with a table of their own (the ARCH template parameter of the dispatch): 90, else 0.
constexpr int kArchDefault = 0;
constexpr int kArchSm90 = 90;

inline int table_arch() { return device_facts().cc_major == 9 ? kArchSm90 : kArchDefault; }

template <typename T, bool HAS_BIAS, bool TANH, int ARCH>
constexpr GeluTune gelu_launch() {
    const int op = HAS_BIAS ? 2 : (TANH ? 1 : 0);
    if (ARCH == kArchSm90) {
        for (const launch_table::GeluRow& r : launch_table::kGeluSm90) {
            if (r.dtype == dtype_code<T>() && r.op == op) return {r.hints, r.cap, r.group};
        }
    }
    return launch_table::kGeluDefault;
}

}  // namespace mograph
