// CUDA kernels, part 3 of kCudaParts (kernels_part.cuh says which lines of the op table it holds).
#define FFN_EXT_CUDA_PART 3
#include "kernels_part.cuh"
