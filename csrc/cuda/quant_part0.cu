// FP8 quantizing kernels, part 0 of kQuantParts (quant_kernels.cuh says which ops it holds); the ops that
// launch them are registered by ops.cpp.
#define FFN_EXT_QUANT_PART 0
#include "quant_kernels.cuh"
