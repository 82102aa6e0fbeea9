// Entry points of libmacattn_trt.so for IPluginRegistry::loadLibrary / trtexec --dynamicPlugins,
// plus the helpers declared in trt_plugin_common.h.
//
// TensorRT looks up two C symbols in a plugin library (TensorRT OSS samples/trtexec/README.md,
// plugin/vc/vfcCommon.h; they are not declared in TensorRT's public headers):
//   extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
//   extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
// getCreators may list IPluginCreatorV3One creators (getPluginCreators is the deprecated variant).
#include "trt_plugin_common.h"

#include <limits>

#include <cmath>
#include <cstdio>
#include <mutex>
#include <sstream>

namespace macattn {
namespace trt {

namespace {
std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder = nullptr;
} // namespace

float specScale(int64_t d) noexcept
{
    return static_cast<float>(1.0 / std::sqrt(static_cast<double>(d)));
}

std::string specList()
{
    std::ostringstream os;
    char const* sep = "";
    for (KernelSpec const& s : kernelSpecs())
    {
        os << sep << s.name << " (Hq=" << s.hq << ", Hkv=" << s.hkv << ", d=" << s.d << ", K=" << s.k
           << ", band=" << s.band << ", tau=" << static_cast<float>(s.tau) << ", scale=" << specScale(s.d) << ")";
        sep = "; ";
    }
    return os.str();
}

void setPluginLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    if (gLoggerFinder == nullptr && finder != nullptr)
    {
        gLoggerFinder = finder;
    }
}

nvinfer1::ILogger* pluginLogger() noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    return gLoggerFinder != nullptr ? gLoggerFinder->findLogger() : nullptr;
}

void reportError(nvinfer1::IErrorRecorder* recorder, std::string const& msg) noexcept
{
    try
    {
        std::string const full = "macattn_trt: " + msg;
        if (recorder != nullptr)
        {
            recorder->reportError(nvinfer1::ErrorCode::kINVALID_ARGUMENT, full.c_str());
            return;
        }
        if (nvinfer1::ILogger* logger = pluginLogger())
        {
            logger->log(nvinfer1::ILogger::Severity::kERROR, full.c_str());
            return;
        }
        std::fprintf(stderr, "%s\n", full.c_str());
    }
    catch (...)
    {
        std::fprintf(stderr, "macattn_trt: error (message lost)\n");
    }
}

namespace
{

bool readIntField(nvinfer1::PluginField const& f, int64_t& value) noexcept
{
    if (f.data == nullptr || f.length != 1)
    {
        return false;
    }
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kINT32: value = *static_cast<int32_t const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kINT64: value = *static_cast<int64_t const*>(f.data); return true;
    default: return false;
    }
}

bool readFloatField(nvinfer1::PluginField const& f, float& value) noexcept
{
    if (f.data == nullptr || f.length != 1)
    {
        return false;
    }
    switch (f.type)
    {
    case nvinfer1::PluginFieldType::kFLOAT32: value = *static_cast<float const*>(f.data); return true;
    case nvinfer1::PluginFieldType::kFLOAT64: value = static_cast<float>(*static_cast<double const*>(f.data)); return true;
    default: return false;
    }
}

} // namespace

std::string noSpecMessage(char const* plugin, std::string const& wanted)
{
    return std::string(kPluginNamespace) + "::" + plugin + ": no compiled kernel for " + wanted
        + " (bf16); macattn_kernels has: " + specList()
        + ". Add the configuration to LIBRARY_SPECS in plugins/aot_library.py and rebuild.";
}

std::string checkBand(char const* plugin, int64_t band)
{
    if (band >= 0 && band <= std::numeric_limits<int32_t>::max())
    {
        return "";
    }
    return std::string(kPluginNamespace) + "::" + plugin + ": band must be an int in [0, 2**31), got "
        + std::to_string(band);
}

std::string parseBandAndValue(char const* plugin, nvinfer1::PluginFieldCollection const* fc, char const* valueField,
    int64_t& band, float& value)
{
    std::string const who = std::string(kPluginNamespace) + "::" + plugin;
    bool haveBand = false, haveValue = false;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        nvinfer1::PluginField const& f = fc->fields[i];
        std::string const name = f.name != nullptr ? f.name : "";
        if (name == "band")
        {
            if (!readIntField(f, band))
            {
                return who + ": field band must be one int32 or int64";
            }
            haveBand = true;
        }
        else if (name == valueField)
        {
            if (!readFloatField(f, value))
            {
                return who + ": field " + valueField + " must be one float32";
            }
            haveValue = true;
        }
    }
    if (!haveBand || !haveValue)
    {
        return who + ": fields band and " + valueField + " are required";
    }
    return "";
}

bool sameDim(nvinfer1::IDimensionExpr const* a, nvinfer1::IDimensionExpr const* b) noexcept
{
    if (a == b || a == nullptr || b == nullptr || !a->isConstant() || !b->isConstant())
    {
        return true;
    }
    return a->getConstantValue() == b->getConstantValue();
}

std::string dimsToString(nvinfer1::DimsExprs const& d)
{
    std::ostringstream os;
    os << "(";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        os << (i ? ", " : "");
        if (d.d[i] != nullptr && d.d[i]->isConstant())
        {
            os << d.d[i]->getConstantValue();
        }
        else
        {
            os << "?";
        }
    }
    os << ")";
    return os.str();
}

std::string dimsToString(nvinfer1::Dims const& d)
{
    std::ostringstream os;
    os << "(";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        os << (i ? ", " : "") << d.d[i];
    }
    os << ")";
    return os.str();
}

char const* dataTypeName(nvinfer1::DataType t) noexcept
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT: return "float32";
    case nvinfer1::DataType::kHALF: return "float16";
    case nvinfer1::DataType::kBF16: return "bfloat16";
    case nvinfer1::DataType::kINT32: return "int32";
    case nvinfer1::DataType::kINT64: return "int64";
    case nvinfer1::DataType::kINT8: return "int8";
    case nvinfer1::DataType::kBOOL: return "bool";
    default: return "other";
    }
}

bool isFloatType(nvinfer1::DataType t) noexcept
{
    return t == nvinfer1::DataType::kFLOAT || t == nvinfer1::DataType::kHALF || t == nvinfer1::DataType::kBF16;
}

int64_t volume(nvinfer1::Dims const& d) noexcept
{
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        v *= d.d[i];
    }
    return v;
}

size_t elementSize(nvinfer1::DataType t) noexcept
{
    switch (t)
    {
    case nvinfer1::DataType::kFLOAT:
    case nvinfer1::DataType::kINT32: return 4;
    case nvinfer1::DataType::kHALF:
    case nvinfer1::DataType::kBF16: return 2;
    case nvinfer1::DataType::kINT64: return 8;
    case nvinfer1::DataType::kINT8:
    case nvinfer1::DataType::kBOOL:
    case nvinfer1::DataType::kUINT8: return 1;
    default: return 0;
    }
}

} // namespace trt
} // namespace macattn

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    macattn::trt::setPluginLoggerFinder(finder);
}

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators)
{
    static nvinfer1::IPluginCreatorInterface* const kCreators[]
        = {macattn::trt::matchCreator(), macattn::trt::attendCreator()};
    nbCreators = 2;
    return kCreators;
}
