// TensorRT plugin mac::match (version "1"), IPluginV3 over the macattn_kernels C library.
//
// Contract: docs/graph.md (MacMatch). Inputs q_pre [B,Hq,d], qring [S,Hq,K,d], ring_lse [S,Hq,K] f32,
// ring_pos [S,K] i64, slots [B] i64, positions [B] i64; outputs match_pos [B,Hq] i64, dist [B,Hq] f32.
// Fields band (int32 / int64), tau (float32). Shape/dtype inference mirrors match_output_specs in
// plugins/mac_match/plugin.py. The compiled kernels are bf16 only, so supportsFormatCombination
// accepts bf16 q_pre / qring (linear); enqueue dispatches on (Hq, d, K, band, tau).
#include "../trt_plugin_common.h"

#include <cmath>
#include <limits>
#include <sstream>

using namespace nvinfer1;

namespace macattn {
namespace trt {
namespace {

constexpr char kMatchName[] = "match";
constexpr int32_t kNbInputs = 6;
constexpr int32_t kNbOutputs = 2;
constexpr char const* kInputNames[kNbInputs] = {"q_pre", "qring", "ring_lse", "ring_pos", "slots", "positions"};
constexpr int32_t kRanks[kNbInputs] = {3, 4, 3, 2, 1, 1};
// Formats TensorRT may pick: what the compiled kernels take (inputs, then outputs).
constexpr DataType kIoTypes[kNbInputs + kNbOutputs] = {DataType::kBF16, DataType::kBF16, DataType::kFLOAT,
    DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kFLOAT};

std::string checkAttrs(int64_t band, float tau)
{
    std::ostringstream os;
    if (band < 0 || band > std::numeric_limits<int32_t>::max())
    {
        os << "mac::match: band must be an int in [0, 2**31), got " << band;
    }
    else if (!(tau >= 0.0f && tau < 1.0f))
    {
        os << "mac::match: tau must be a float in [0, 1), got " << tau;
    }
    return os.str();
}

// The specialisation for these static dims and fields, or nullptr.
KernelSpec const* findSpec(int64_t hq, int64_t d, int64_t k, int64_t band, float tau) noexcept
{
    for (KernelSpec const& s : kernelSpecs())
    {
        if (s.hq == hq && s.d == d && s.k == k && s.band == band && static_cast<float>(s.tau) == tau)
        {
            return &s;
        }
    }
    return nullptr;
}

std::string noSpecMessage(int64_t hq, int64_t d, int64_t k, int64_t band, float tau)
{
    std::ostringstream os;
    os << "mac::match: no compiled kernel for Hq=" << hq << ", d=" << d << ", K=" << k << ", band=" << band
       << ", tau=" << tau << " (bf16); macattn_kernels has: " << specList()
       << ". Add the configuration to LIBRARY_SPECS in plugins/aot_library.py and rebuild.";
    return os.str();
}

class MatchPlugin : public IPluginV3, public IPluginV3OneCore, public IPluginV3OneBuild, public IPluginV3OneRuntime
{
public:
    MatchPlugin(int64_t band, float tau) noexcept
        : mBand(band)
        , mTau(tau)
    {
    }

    // IPluginV3
    IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override
    {
        switch (type)
        {
        case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
        case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuild*>(this);
        case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
        }
        return nullptr;
    }

    IPluginV3* clone() noexcept override
    {
        try
        {
            auto* p = new MatchPlugin(mBand, mTau);
            p->mRecorder = mRecorder;
            return p;
        }
        catch (...)
        {
            return nullptr;
        }
    }

    // IPluginV3OneCore
    AsciiChar const* getPluginName() const noexcept override { return kMatchName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

    // IPluginV3OneBuild
    int32_t getNbOutputs() const noexcept override { return kNbOutputs; }

    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        try
        {
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
            {
                return fail("mac::match takes 6 inputs (q_pre, qring, ring_lse, ring_pos, slots, positions) and "
                            "gives 2 outputs, got " + std::to_string(nbInputs) + " / " + std::to_string(nbOutputs));
            }
            for (int32_t i = 0; i < 2; ++i)
            {
                if (!isFloatType(inputTypes[i]))
                {
                    return fail(std::string("mac::match: ") + kInputNames[i] + " must be float32/float16/bfloat16, got "
                        + dataTypeName(inputTypes[i]));
                }
            }
            DataType const want[4] = {DataType::kFLOAT, DataType::kINT64, DataType::kINT64, DataType::kINT64};
            for (int32_t i = 2; i < kNbInputs; ++i)
            {
                if (inputTypes[i] != want[i - 2])
                {
                    return fail(std::string("mac::match: ") + kInputNames[i] + " must be " + dataTypeName(want[i - 2])
                        + ", got " + dataTypeName(inputTypes[i]));
                }
            }
            outputTypes[0] = DataType::kINT64;   // match_pos
            outputTypes[1] = DataType::kFLOAT;   // dist
            return 0;
        }
        catch (...)
        {
            return -1;
        }
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /* shapeInputs */,
        int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& /* exprBuilder */) noexcept override
    {
        try
        {
            std::string const attrs = checkAttrs(mBand, mTau);
            if (!attrs.empty())
            {
                return fail(attrs);
            }
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || nbShapeInputs != 0)
            {
                return fail("mac::match takes 6 inputs and gives 2 outputs, got " + std::to_string(nbInputs) + " / "
                    + std::to_string(nbOutputs));
            }
            for (int32_t i = 0; i < kNbInputs; ++i)
            {
                if (inputs[i].nbDims != kRanks[i])
                {
                    return fail(std::string("mac::match: ") + kInputNames[i] + " must have rank "
                        + std::to_string(kRanks[i]) + ", got " + std::to_string(inputs[i].nbDims));
                }
            }
            // q_pre [B, Hq, d]; qring [S, Hq, K, d]
            IDimensionExpr const* B = inputs[0].d[0];
            IDimensionExpr const* Hq = inputs[0].d[1];
            IDimensionExpr const* d = inputs[0].d[2];
            IDimensionExpr const* S = inputs[1].d[0];
            IDimensionExpr const* K = inputs[1].d[2];
            struct Check
            {
                int32_t input;
                std::vector<IDimensionExpr const*> want;
            };
            Check const checks[] = {{1, {S, Hq, K, d}}, {2, {S, Hq, K}}, {3, {S, K}}, {4, {B}}, {5, {B}}};
            for (Check const& c : checks)
            {
                for (size_t j = 0; j < c.want.size(); ++j)
                {
                    if (!sameDim(inputs[c.input].d[j], c.want[j]))
                    {
                        return fail(std::string("mac::match: ") + kInputNames[c.input] + " shape "
                            + dimsToString(inputs[c.input]) + " does not fit q_pre [B, Hq, d] / qring [S, Hq, K, d]");
                    }
                }
            }
            outputs[0].nbDims = 2;   // match_pos [B, Hq]
            outputs[0].d[0] = B;
            outputs[0].d[1] = Hq;
            outputs[1].nbDims = 2;   // dist [B, Hq]
            outputs[1].d[0] = B;
            outputs[1].d[1] = Hq;
            return 0;
        }
        catch (...)
        {
            return -1;
        }
    }

    bool supportsFormatCombination(
        int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept override
    {
        if (nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 || pos >= kNbInputs + kNbOutputs)
        {
            return false;
        }
        return inOut[pos].desc.format == TensorFormat::kLINEAR && inOut[pos].desc.type == kIoTypes[pos];
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /* out */,
        int32_t nbOutputs) noexcept override
    {
        try
        {
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
            {
                return fail("mac::match: wrong number of inputs/outputs");
            }
            // Hq, d, K are constexprs of the kernels: static in the graph (-1 = dynamic).
            int64_t const hq = in[0].desc.dims.d[1], d = in[0].desc.dims.d[2], k = in[1].desc.dims.d[2];
            if (hq < 0 || d < 0 || k < 0)
            {
                return fail("mac::match: Hq (q_pre dim 1), d (q_pre dim 2) and K (qring dim 2) must be build-time "
                            "constants, got q_pre " + dimsToString(in[0].desc.dims) + ", qring "
                    + dimsToString(in[1].desc.dims));
            }
            if (findSpec(hq, d, k, mBand, mTau) == nullptr)
            {
                return fail(noSpecMessage(hq, d, k, mBand, mTau));
            }
            return 0;
        }
        catch (...)
        {
            return -1;
        }
    }

    // IPluginV3OneRuntime
    int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /* out */,
        int32_t nbOutputs) noexcept override
    {
        try
        {
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
            {
                return fail("mac::match: wrong number of inputs/outputs");
            }
            int64_t const hq = in[0].dims.d[1], d = in[0].dims.d[2], k = in[1].dims.d[2];
            if (findSpec(hq, d, k, mBand, mTau) == nullptr)
            {
                return fail(noSpecMessage(hq, d, k, mBand, mTau));
            }
            return 0;
        }
        catch (...)
        {
            return -1;
        }
    }

    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /* outputDesc */,
        void const* const* inputs, void* const* outputs, void* /* workspace */, cudaStream_t stream) noexcept override
    {
        try
        {
            int64_t const B = inputDesc[0].dims.d[0];
            int64_t const hq = inputDesc[0].dims.d[1], d = inputDesc[0].dims.d[2], k = inputDesc[1].dims.d[2];
            KernelSpec const* spec = findSpec(hq, d, k, mBand, mTau);
            if (spec == nullptr)
            {
                return fail(noSpecMessage(hq, d, k, mBand, mTau));
            }
            if (B < 0 || B > std::numeric_limits<int32_t>::max())
            {
                return fail("mac::match: batch B=" + std::to_string(B) + " does not fit the kernel's int32");
            }
            if (B == 0)
            {
                return 0;   // empty grid: nothing to launch (the Triton launcher has no return for it)
            }
            auto ptr = [](void const* p) { return reinterpret_cast<CUdeviceptr>(p); };
            CUresult const r = spec->match(reinterpret_cast<CUstream>(stream), ptr(inputs[0]), ptr(inputs[1]),
                ptr(inputs[2]), ptr(inputs[3]), ptr(inputs[4]), ptr(inputs[5]), static_cast<int32_t>(B),
                ptr(outputs[0]), ptr(outputs[1]));
            if (r != CUDA_SUCCESS)
            {
                return fail(std::string("mac::match: macattn_match_") + spec->name + " failed with CUresult "
                    + std::to_string(static_cast<int>(r)));
            }
            return 0;
        }
        catch (...)
        {
            return -1;
        }
    }

    IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override
    {
        auto* p = static_cast<MatchPlugin*>(clone());
        if (p != nullptr && context != nullptr)
        {
            p->mRecorder = context->getErrorRecorder();
        }
        return p;
    }

    PluginFieldCollection const* getFieldsToSerialize() noexcept override
    {
        mBand32 = static_cast<int32_t>(mBand);
        mFields[0] = PluginField("band", &mBand32, PluginFieldType::kINT32, 1);
        mFields[1] = PluginField("tau", &mTau, PluginFieldType::kFLOAT32, 1);
        mFieldCollection.nbFields = 2;
        mFieldCollection.fields = mFields;
        return &mFieldCollection;
    }

private:
    int32_t fail(std::string const& msg) const noexcept
    {
        reportError(mRecorder, msg);
        return -1;
    }

    int64_t mBand;
    float mTau;
    int32_t mBand32{0};
    IErrorRecorder* mRecorder{nullptr};
    PluginField mFields[2];
    PluginFieldCollection mFieldCollection{};
};

class MatchCreator : public IPluginCreatorV3One
{
public:
    MatchCreator()
    {
        // Declared types: the ONNX parser converts node attributes to these (INT -> int32, FLOAT -> float32).
        mFields[0] = PluginField("band", nullptr, PluginFieldType::kINT32, 1);
        mFields[1] = PluginField("tau", nullptr, PluginFieldType::kFLOAT32, 1);
        mFieldCollection.nbFields = 2;
        mFieldCollection.fields = mFields;
    }

    AsciiChar const* getPluginName() const noexcept override { return kMatchName; }
    AsciiChar const* getPluginVersion() const noexcept override { return kPluginVersion; }
    AsciiChar const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
    PluginFieldCollection const* getFieldNames() noexcept override { return &mFieldCollection; }

    IPluginV3* createPlugin(AsciiChar const* /* name */, PluginFieldCollection const* fc,
        TensorRTPhase /* phase */) noexcept override
    {
        try
        {
            bool haveBand = false, haveTau = false;
            int64_t band = 0;
            float tau = 0.0f;
            for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
            {
                PluginField const& f = fc->fields[i];
                std::string const name = f.name != nullptr ? f.name : "";
                if (name == "band")
                {
                    if (!readIntField(f, band))
                    {
                        reportError(nullptr, "mac::match: field band must be one int32 or int64");
                        return nullptr;
                    }
                    haveBand = true;
                }
                else if (name == "tau")
                {
                    if (!readFloatField(f, tau))
                    {
                        reportError(nullptr, "mac::match: field tau must be one float32");
                        return nullptr;
                    }
                    haveTau = true;
                }
            }
            if (!haveBand || !haveTau)
            {
                reportError(nullptr, "mac::match: fields band and tau are required");
                return nullptr;
            }
            std::string const attrs = checkAttrs(band, tau);
            if (!attrs.empty())
            {
                reportError(nullptr, attrs);
                return nullptr;
            }
            return new MatchPlugin(band, tau);
        }
        catch (...)
        {
            return nullptr;
        }
    }

private:
    PluginField mFields[2];
    PluginFieldCollection mFieldCollection{};
};

} // namespace

IPluginCreatorInterface* matchCreator() noexcept
{
    static MatchCreator creator;
    return &creator;
}

} // namespace trt
} // namespace macattn
