// Shared pieces of the native TensorRT plugins mac::match and mac::attend (IPluginV3).
//
// The op contract (inputs, outputs, dtypes, fields band / tau / scale) is docs/graph.md; the
// shape and dtype inference mirrors plugins/mac_match/plugin.py and plugins/mac_attend/plugin.py.
// The kernels are the C library macattn_kernels (plugins/aot_library.py, macattn_kernels.h):
// one entry point per specialisation baked for (Hq, Hkv, d, K, band, tau | scale=1/sqrt(d), bf16).
// Needs TensorRT >= 10.3 headers (IPluginV3OneBuildV2 for the aliased ring outputs).
#pragma once

#include <NvInferRuntime.h>
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>

extern "C" {
#include "macattn_kernels.h"   // C header without extern "C" guards of its own
}

#include <string>
#include <vector>

namespace macattn {
namespace trt {

constexpr char kPluginNamespace[] = "mac";
constexpr char kPluginVersion[] = "1";

using MatchFn = CUresult (*)(CUstream, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr,
                             int32_t, CUdeviceptr, CUdeviceptr);
using AttendFn = CUresult (*)(CUstream, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr,
                              CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, int32_t, int32_t,
                              CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr, CUdeviceptr);

// One compiled specialisation of macattn_kernels: the table is the generated MACATTN_KERNEL_SPECS
// of macattn_kernels.h (from LIBRARY_SPECS in plugins/aot_library.py). tau and scale are compared as float32: that is how the kernels bake them
// (THR from float32(tau), SCALE_LOG2 from float32(d ** -0.5)) and how the plugin fields carry them.
struct KernelSpec
{
    char const* name;
    int64_t hq, hkv, d, k, band;
    double tau;
    MatchFn match;
    AttendFn attend;
};

inline std::vector<KernelSpec> const& kernelSpecs()
{
#define MACATTN_SPEC_ROW(n, hq, hkv, d, k, band, tau) {#n, hq, hkv, d, k, band, tau, &macattn_match_##n, &macattn_attend_##n},
    static std::vector<KernelSpec> const specs{MACATTN_KERNEL_SPECS(MACATTN_SPEC_ROW)};
#undef MACATTN_SPEC_ROW
    return specs;
}

// float32(1 / sqrt(d)), exactly as plugins/aot_library.py passes scale=d ** -0.5 to the kernel.
float specScale(int64_t d) noexcept;

// "llama8b (Hq=32, Hkv=8, d=128, K=1024, band=256, tau=0.45, scale=0.0883883)|..." for error messages.
std::string specList();

// Error reporting: the plugin's error recorder when attached to an execution context, else the
// logger TensorRT handed to setLoggerFinder, else stderr.
nvinfer1::ILogger* pluginLogger() noexcept;
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void reportError(nvinfer1::IErrorRecorder* recorder, std::string const& msg) noexcept;

// Plugin fields: band as kINT32 or kINT64, tau / scale as kFLOAT32 or kFLOAT64 (one element each).
bool readIntField(nvinfer1::PluginField const& f, int64_t& value) noexcept;
bool readFloatField(nvinfer1::PluginField const& f, float& value) noexcept;

// Dims helpers over IDimensionExpr (TensorRT's ShapeExpr), as plugins/aot.py same_dim/static_dim:
// two dims disagree only when both are build-time constants and differ.
bool sameDim(nvinfer1::IDimensionExpr const* a, nvinfer1::IDimensionExpr const* b) noexcept;
std::string dimsToString(nvinfer1::DimsExprs const& d);
std::string dimsToString(nvinfer1::Dims const& d);
char const* dataTypeName(nvinfer1::DataType t) noexcept;
bool isFloatType(nvinfer1::DataType t) noexcept;   // float32 / float16 / bf16
int64_t volume(nvinfer1::Dims const& d) noexcept;
size_t elementSize(nvinfer1::DataType t) noexcept;

// The creators, one per plugin (static instances), listed by getCreators in trt_plugin_library.cpp.
nvinfer1::IPluginCreatorInterface* matchCreator() noexcept;
nvinfer1::IPluginCreatorInterface* attendCreator() noexcept;

} // namespace trt
} // namespace macattn
