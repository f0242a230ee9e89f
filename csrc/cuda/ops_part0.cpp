// CUDA ops, part 0 of kCudaParts: their registration (ops_part.h); the kernels are kernels_part0.cu.
#define FFN_EXT_CUDA_PART 0
#include "ops_part.h"
