// api.cu - dtype-independent entry points: ABI version and status strings.
#include <cuda_runtime.h>

#include "mograph_kernels.h"

extern "C" {

MOGRAPH_API int mograph_kernels_abi_version(void) { return MOGRAPH_KERNELS_ABI_VERSION; }

MOGRAPH_API const char* mograph_kernels_status_string(int status) {
    switch (status) {
        case MOGRAPH_OK:
            return "ok";
        case MOGRAPH_ERR_INVALID_ARGUMENT:
            return "invalid argument (null required pointer, negative size, hidden < 1, or unknown flags)";
        case MOGRAPH_ERR_UNSUPPORTED:
            return "unsupported size (hidden > INT32_MAX)";
        default:
            break;
    }
    if (status > MOGRAPH_ERR_CUDA_BASE) {
        return cudaGetErrorString(static_cast<cudaError_t>(status - MOGRAPH_ERR_CUDA_BASE));
    }
    return "unknown status";
}

}  // extern "C"
