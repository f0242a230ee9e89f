// The Python module ffn_ext._C (python_module.cpp) and two of its test paths (test_paths.cpp,
// test_paths_quant.cpp) compiled as one translation unit: compiled alone each spent about 9.5 CPU-s parsing
// pybind11 and the torch headers, and on 2 cores a build is bound by total CPU time (g++ 12, -O3, 2026-12-02).
// test_paths_rows.cpp stays a job of its own: its instantiations (60 CPU-s) are the largest of the build, and a
// job that long must be able to start early and run beside the others.
#include "python_module.cpp"
#include "test_paths.cpp"
#include "test_paths_quant.cpp"
