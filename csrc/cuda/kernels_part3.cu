// CUDA kernels, part 3 of kCudaParts (kernels_part.cuh says which lines of the op table it holds); the ops that
// launch them are registered by ops.cpp.
#define FFN_EXT_CUDA_PART 3
#include "kernels_part.cuh"
