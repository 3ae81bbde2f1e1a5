// The kernel test/tune entry points of edgevlm_ros._engine (bindings_kernels.cpp), registered by
// the module definition (bindings.cpp) next to the model API.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

#include "../kernels/formats/formats.h"

void register_kernel_bindings(pybind11::module_& m);

// A KV cache type by its Python name ('f32', 'f16', 'q8_0'); ValueError naming them otherwise.
evk::DType kv_type_named(const std::string& name);
