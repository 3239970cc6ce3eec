// ops_f16.cu - the f16 entry points of mograph_kernels.h (see entry_points.cuh).
#define MOGRAPH_DTYPE __half
#define MOGRAPH_SUFFIX f16
#include "entry_points.cuh"
