// CUDA ops, part 1 of kCudaParts: their registration (ops_part.h); the kernels are kernels_part1.cu.
#define FFN_EXT_CUDA_PART 1
#include "ops_part.h"
