// CUDA ops, part 3 of kCudaParts: their registration (ops_part.h); the kernels are kernels_part3.cu.
#define FFN_EXT_CUDA_PART 3
#include "ops_part.h"
