// ops_f32.cu - the f32 entry points of mograph_kernels.h (see entry_points.cuh).
#define MOGRAPH_DTYPE float
#define MOGRAPH_SUFFIX f32
#include "entry_points.cuh"
