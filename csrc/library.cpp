// The library's sources (registration.cpp, shapes.cpp, quant.cpp, quant_recipe.cpp, ops_api.cpp) compiled as one
// translation unit: each is its own file to read, but each one compiled alone spent much of its time parsing the
// same ATen and torch headers, and on 2 cores a build is bound by total CPU time, not by the longest job (figures: docs/building.md#build-time). They define nothing twice: helpers private to a file
// live in an unnamed namespace of their own namespace.
#include "ops_api.cpp"
#include "quant.cpp"
#include "quant_recipe.cpp"
#include "registration.cpp"
#include "shapes.cpp"
