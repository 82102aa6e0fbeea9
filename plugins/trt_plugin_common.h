// Shared pieces of the native TensorRT plugins mac::match and mac::attend (IPluginV3).
//
// The op contract (inputs, outputs, dtypes, fields band / tau / scale) is docs/graph.md; the
// shape and dtype inference mirrors plugins/mac/match_plugin.py and plugins/mac/attend_plugin.py.
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

#include <initializer_list>
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

// "mac::<plugin>: no compiled kernel for <wanted> (bf16); macattn_kernels has: <specList()>. Add ...".
std::string noSpecMessage(char const* plugin, std::string const& wanted);

// "" if ``band`` is an int in [0, 2**31), else the message naming the plugin and the range.
std::string checkBand(char const* plugin, int64_t band);

// Error reporting: the plugin's error recorder when attached to an execution context, else the
// logger TensorRT handed to setLoggerFinder, else stderr.
nvinfer1::ILogger* pluginLogger() noexcept;
void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void reportError(nvinfer1::IErrorRecorder* recorder, std::string const& msg) noexcept;


// Dims helpers over IDimensionExpr (TensorRT's ShapeExpr), as plugins/aot.py same_dim/static_dim:
// two dims disagree only when both are build-time constants and differ.
bool sameDim(nvinfer1::IDimensionExpr const* a, nvinfer1::IDimensionExpr const* b) noexcept;
std::string dimsToString(nvinfer1::DimsExprs const& d);
std::string dimsToString(nvinfer1::Dims const& d);
char const* dataTypeName(nvinfer1::DataType t) noexcept;
bool isFloatType(nvinfer1::DataType t) noexcept;   // float32 / float16 / bf16
int64_t volume(nvinfer1::Dims const& d) noexcept;
size_t elementSize(nvinfer1::DataType t) noexcept;

// The one field parser of every creator: each macattn plugin carries ``band`` (int32 / int64) and one
// float field ``valueField`` (tau / scale; float32 / float64). Returns "" or a message naming the
// plugin, the field and the accepted types.
std::string parseBandAndValue(char const* plugin, nvinfer1::PluginFieldCollection const* fc, char const* valueField,
    int64_t& band, float& value);

// What distinguishes one plugin for the shared bases below (one constexpr instance per plugin).
struct PluginTraits
{
    char const* name;                  // plugin name in namespace kPluginNamespace ("match", "attend")
    char const* valueField;            // its float field beside band ("tau", "scale")
    int32_t nbInputs;
    int32_t nbOutputs;
    int32_t const* ranks;              // [nbInputs]
    char const* const* inputNames;     // [nbInputs]
    nvinfer1::DataType const* ioTypes; // [nbInputs + nbOutputs]: the formats the compiled kernels take
};

// What every macattn plugin shares (TensorRT-LLM's plugins/common/plugin.h plays this role there):
// the capability table, clone / attachToContext, names, the serialised fields (band, Derived::kTraits.valueField),
// the format table (Derived::kTraits.ioTypes over Derived::kTraits.nbInputs + kNbOutputs), onShapeChange through
// Derived::lookup (the compiled specialisation for the runtime shapes), and error reporting; what differs
// per plugin is Derived::kTraits (PluginTraits).
// Build is IPluginV3OneBuild, or IPluginV3OneBuildV2 for a plugin with aliased outputs.
template <typename Derived, typename Build>
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public Build,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    PluginBase(int64_t band, float value) noexcept
        : mBand(band)
        , mValue(value)
    {
    }

    // The fields' rules: band here, the float field by Derived::checkValue.
    static std::string checkAttrs(int64_t band, float value)
    {
        std::string const err = checkBand(Derived::kTraits.name, band);
        return err.empty() ? Derived::checkValue(value) : err;
    }

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<Build*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    nvinfer1::IPluginV3* clone() noexcept override
    {
        try
        {
            auto* p = new Derived(mBand, mValue);
            p->mRecorder = mRecorder;
            return p;
        }
        catch (...)
        {
            return nullptr;
        }
    }

    // IPluginV3OneCore
    nvinfer1::AsciiChar const* getPluginName() const noexcept override { return Derived::kTraits.name; }
    nvinfer1::AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    nvinfer1::AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return Derived::kTraits.nbOutputs; }

    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override
    {
        if (nbInputs != Derived::kTraits.nbInputs || nbOutputs != Derived::kTraits.nbOutputs || pos < 0
            || pos >= Derived::kTraits.nbInputs + Derived::kTraits.nbOutputs)
        {
            return false;
        }
        return inOut[pos].desc.format == nvinfer1::TensorFormat::kLINEAR
            && inOut[pos].desc.type == Derived::kTraits.ioTypes[pos];
    }

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* /* out */, int32_t nbOutputs) noexcept override
    {
        try
        {
            if (nbInputs != Derived::kTraits.nbInputs || nbOutputs != Derived::kTraits.nbOutputs)
            {
                return fail(std::string(kPluginNamespace) + "::" + Derived::kTraits.name + ": wrong number of inputs/outputs");
            }
            return specFor(in) != nullptr ? 0 : -1;
        }
        catch (...)
        {
            return -1;
        }
    }

    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override
    {
        auto* p = static_cast<Derived*>(clone());
        if (p != nullptr && context != nullptr)
        {
            p->mRecorder = context->getErrorRecorder();
        }
        return p;
    }

    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mBand32 = static_cast<int32_t>(mBand);
        mFields[0] = nvinfer1::PluginField("band", &mBand32, nvinfer1::PluginFieldType::kINT32, 1);
        mFields[1] = nvinfer1::PluginField(Derived::kTraits.valueField, &mValue, nvinfer1::PluginFieldType::kFLOAT32, 1);
        mFieldCollection.nbFields = 2;
        mFieldCollection.fields = mFields;
        return &mFieldCollection;
    }

protected:
    int32_t fail(std::string const& msg) const noexcept
    {
        reportError(mRecorder, msg);
        return -1;
    }

    // Runs ``body`` (returning 0 or -1); an exception becomes -1 (nothing may escape a noexcept override).
    template <typename F>
    static int32_t guarded(F&& body) noexcept
    {
        try
        {
            return body();
        }
        catch (...)
        {
            return -1;
        }
    }

    // enqueue's last step: 0 if the kernel launch ``r`` of entry point ``kernel`` succeeded.
    int32_t launched(CUresult r, char const* kernel, char const* specName) const noexcept
    {
        if (r == CUDA_SUCCESS)
        {
            return 0;
        }
        return fail(std::string(kPluginNamespace) + "::" + Derived::kTraits.name + ": macattn_" + kernel + "_" + specName
            + " failed with CUresult " + std::to_string(static_cast<int>(r)));
    }

    // One input's expected dims (expressions of the other inputs' dims).
    struct DimCheck
    {
        int32_t input;
        std::vector<nvinfer1::IDimensionExpr const*> want;
    };

    // 0 if every input of ``checks`` fits its expected dims (sameDim), else -1 with the error reported
    // (``layout``: the reference inputs' shapes, for the message).
    int32_t checkDims(nvinfer1::DimsExprs const* inputs, std::initializer_list<DimCheck> checks, char const* layout) const
    {
        for (DimCheck const& c : checks)
        {
            for (size_t j = 0; j < c.want.size(); ++j)
            {
                if (!sameDim(inputs[c.input].d[j], c.want[j]))
                {
                    return fail(std::string(kPluginNamespace) + "::" + Derived::kTraits.name + ": "
                        + Derived::kTraits.inputNames[c.input] + " shape " + dimsToString(inputs[c.input])
                        + " does not fit " + layout);
                }
            }
        }
        return 0;
    }

    // The compiled specialisation for the runtime shapes ``in`` (Derived::lookup), or nullptr with the
    // error reported.
    KernelSpec const* specFor(nvinfer1::PluginTensorDesc const* in) const
    {
        std::string err;
        KernelSpec const* spec = static_cast<Derived const*>(this)->lookup(in, err);
        if (spec == nullptr)
        {
            fail(err);
        }
        return spec;
    }

    // getOutputShapes' checks shared by every plugin: the fields, the input / output counts and each
    // input's rank (Derived::kTraits.ranks, Derived::kTraits.inputNames). 0, or -1 with the error reported.
    int32_t checkShapeInputs(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, int32_t nbShapeInputs,
        int32_t nbOutputs) const
    {
        std::string const who = std::string(kPluginNamespace) + "::" + Derived::kTraits.name;
        std::string const attrs = Derived::checkAttrs(mBand, mValue);
        if (!attrs.empty())
        {
            return fail(attrs);
        }
        if (nbInputs != Derived::kTraits.nbInputs || nbOutputs != Derived::kTraits.nbOutputs || nbShapeInputs != 0)
        {
            return fail(who + " takes " + std::to_string(Derived::kTraits.nbInputs) + " inputs and gives "
                + std::to_string(Derived::kTraits.nbOutputs) + " outputs, got " + std::to_string(nbInputs) + " / "
                + std::to_string(nbOutputs));
        }
        for (int32_t i = 0; i < Derived::kTraits.nbInputs; ++i)
        {
            if (inputs[i].nbDims != Derived::kTraits.ranks[i])
            {
                return fail(who + ": " + Derived::kTraits.inputNames[i] + " must have rank " + std::to_string(Derived::kTraits.ranks[i])
                    + ", got " + std::to_string(inputs[i].nbDims));
            }
        }
        return 0;
    }

    int64_t mBand;
    float mValue;

private:
    int32_t mBand32{0};
    nvinfer1::IErrorRecorder* mRecorder{nullptr};
    nvinfer1::PluginField mFields[2];
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

// The creator of plugin Derived: declares the fields (band int32, Derived::kTraits.valueField float32: the
// types the ONNX parser converts node attributes to), parses them with parseBandAndValue, validates
// them with Derived::checkAttrs and builds Derived(band, value).
template <typename Derived>
class CreatorBase : public nvinfer1::IPluginCreatorV3One
{
public:
    CreatorBase()
    {
        mFields[0] = nvinfer1::PluginField("band", nullptr, nvinfer1::PluginFieldType::kINT32, 1);
        mFields[1] = nvinfer1::PluginField(Derived::kTraits.valueField, nullptr, nvinfer1::PluginFieldType::kFLOAT32, 1);
        mFieldCollection.nbFields = 2;
        mFieldCollection.fields = mFields;
    }

    nvinfer1::AsciiChar const* getPluginName() const noexcept override { return Derived::kTraits.name; }
    nvinfer1::AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    nvinfer1::AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldCollection; }

    nvinfer1::IPluginV3* createPlugin(nvinfer1::AsciiChar const* /* name */, nvinfer1::PluginFieldCollection const* fc,
        nvinfer1::TensorRTPhase /* phase */) noexcept override
    {
        try
        {
            int64_t band = 0;
            float value = 0.0f;
            std::string err = parseBandAndValue(Derived::kTraits.name, fc, Derived::kTraits.valueField, band, value);
            if (err.empty())
            {
                err = Derived::checkAttrs(band, value);
            }
            if (!err.empty())
            {
                reportError(nullptr, err);
                return nullptr;
            }
            return new Derived(band, value);
        }
        catch (...)
        {
            return nullptr;
        }
    }

private:
    nvinfer1::PluginField mFields[2];
    nvinfer1::PluginFieldCollection mFieldCollection{};
};

// The one creator instance of plugin Derived.
template <typename Derived>
nvinfer1::IPluginCreatorInterface* creatorInstance() noexcept
{
    static CreatorBase<Derived> creator;
    return &creator;
}

// The creators, one per plugin, listed by getCreators in trt_plugin_library.cpp.
nvinfer1::IPluginCreatorInterface* matchCreator() noexcept;
nvinfer1::IPluginCreatorInterface* attendCreator() noexcept;

} // namespace trt
} // namespace macattn
