// The kernel test/tune entry points of edgevlm_ros._engine (bindings_kernels.cpp), registered by
// the module definition (bindings.cpp) next to the model API.
#pragma once
#include <pybind11/pybind11.h>

void register_kernel_bindings(pybind11::module_& m);
