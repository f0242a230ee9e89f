// libffn_ext_ops.so's own symbol (CMake target ffn_ext_ops, for C++ consumers; not in ffn_ext._C): the header-only
// <ffn_ext/ops.h> references it, so a program that includes the header keeps the library in its link (and the
// schemas of registration.cpp register at load) also under the linker's --as-needed.
#include <ffn_ext/ops.h>

extern "C" __attribute__((visibility("default"))) int ffn_ext_ops_library() { return FFN_EXT_OPS_API_VERSION; }
