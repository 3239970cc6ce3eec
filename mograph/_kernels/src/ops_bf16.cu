// ops_bf16.cu - the bf16 entry points of mograph_kernels.h (see entry_points.cuh).
#define MOGRAPH_DTYPE __nv_bfloat16
#define MOGRAPH_SUFFIX bf16
#include "entry_points.cuh"
