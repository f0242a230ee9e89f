// The library's sources (registration.cpp, shapes.cpp, aten_ops.cpp, quant.cpp, quant_recipe.cpp, ops_api.cpp,
// autograd.cpp) compiled as one translation unit: each is its own file to read, but each one compiled alone spent
// 7-12 of its 7-37 CPU-s parsing the same ATen and torch headers, and on 2 cores a build is bound by total CPU
// time, not by the longest job (g++ 12, -O3, 2026-12-02: 62 CPU-s as the first five, 60 as this file and
// autograd.cpp, 53 as one; see docs/building.md for the build's figures). They define nothing twice: helpers
// private to a file live in an unnamed namespace of their own namespace.
#include "aten_ops.cpp"
#include "autograd.cpp"
#include "ops_api.cpp"
#include "quant.cpp"
#include "quant_recipe.cpp"
#include "registration.cpp"
#include "shapes.cpp"
