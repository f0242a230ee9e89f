// CUDA ops, part 2 of kCudaParts: their registration (ops_part.h); the kernels are kernels_part2.cu.
#define FFN_EXT_CUDA_PART 2
#include "ops_part.h"
