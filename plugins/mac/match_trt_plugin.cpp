// TensorRT plugin mac::match (version "1"), IPluginV3 over the macattn_kernels C library.
//
// Contract: docs/graph.md (MacMatch). Inputs q_pre [B,Hq,d], qring [S,Hq,K,d], ring_lse [S,Hq,K] f32,
// ring_pos [S,K] i64, slots [B] i64, positions [B] i64; outputs match_pos [B,Hq] i64, dist [B,Hq] f32.
// Fields band (int32 / int64), tau (float32). Shape/dtype inference mirrors match_output_specs in
// plugins/mac/match_plugin.py. The compiled kernels are bf16 only, so supportsFormatCombination
// accepts bf16 q_pre / qring (linear); enqueue dispatches on (Hq, d, K, band, tau).
#include "../trt_plugin_common.h"

#include <cmath>
#include <limits>
#include <sstream>

using namespace nvinfer1;

namespace macattn {
namespace trt {
namespace {

constexpr int32_t kNbInputs = 6;
constexpr int32_t kNbOutputs = 2;
constexpr char const* kInputNames[kNbInputs] = {"q_pre", "qring", "ring_lse", "ring_pos", "slots", "positions"};
constexpr int32_t kRanks[kNbInputs] = {3, 4, 3, 2, 1, 1};

// Formats TensorRT may pick: what the compiled kernels take (inputs, then outputs).
constexpr DataType kIoTypes[kNbInputs + kNbOutputs] = {DataType::kBF16, DataType::kBF16, DataType::kFLOAT,
    DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kFLOAT};

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

std::string wanted(int64_t hq, int64_t d, int64_t k, int64_t band, float tau)
{
    std::ostringstream os;
    os << "Hq=" << hq << ", d=" << d << ", K=" << k << ", band=" << band << ", tau=" << tau;
    return os.str();
}

class MatchPlugin : public PluginBase<MatchPlugin, IPluginV3OneBuild>
{
public:
    static constexpr PluginTraits kTraits{"match", "tau", kNbInputs, kNbOutputs, kRanks, kInputNames, kIoTypes};

    using PluginBase::PluginBase;

    static std::string checkValue(float tau)
    {
        std::ostringstream os;
        if (!(tau >= 0.0f && tau < 1.0f))
        {
            os << "mac::match: tau must be a float in [0, 1), got " << tau;
        }
        return os.str();
    }

    // The compiled specialisation for the runtime shapes ``in`` (nullptr and ``err`` set if none).
    KernelSpec const* lookup(PluginTensorDesc const* in, std::string& err) const
    {
        int64_t const hq = in[0].dims.d[1], d = in[0].dims.d[2], k = in[1].dims.d[2];
        KernelSpec const* spec = findSpec(hq, d, k, mBand, mValue);
        if (spec == nullptr)
        {
            err = noSpecMessage("match", wanted(hq, d, k, mBand, mValue));
        }
        return spec;
    }

    // IPluginV3OneBuild
    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        return guarded([&]() -> int32_t {
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
        });
    }

    int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /* shapeInputs */,
        int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs, IExprBuilder& /* exprBuilder */) noexcept override
    {
        return guarded([&]() -> int32_t {
            if (checkShapeInputs(inputs, nbInputs, nbShapeInputs, nbOutputs) != 0)
            {
                return -1;
            }
            // q_pre [B, Hq, d]; qring [S, Hq, K, d]
            IDimensionExpr const* B = inputs[0].d[0];
            IDimensionExpr const* Hq = inputs[0].d[1];
            IDimensionExpr const* d = inputs[0].d[2];
            IDimensionExpr const* S = inputs[1].d[0];
            IDimensionExpr const* K = inputs[1].d[2];
            if (checkDims(inputs, {{1, {S, Hq, K, d}}, {2, {S, Hq, K}}, {3, {S, K}}, {4, {B}}, {5, {B}}},
                    "q_pre [B, Hq, d] / qring [S, Hq, K, d]")
                != 0)
            {
                return -1;
            }
            outputs[0].nbDims = 2;   // match_pos [B, Hq]
            outputs[0].d[0] = B;
            outputs[0].d[1] = Hq;
            outputs[1].nbDims = 2;   // dist [B, Hq]
            outputs[1].d[0] = B;
            outputs[1].d[1] = Hq;
            return 0;
        });
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /* out */,
        int32_t nbOutputs) noexcept override
    {
        return guarded([&]() -> int32_t {
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
            if (findSpec(hq, d, k, mBand, mValue) == nullptr)
            {
                return fail(noSpecMessage("match", wanted(hq, d, k, mBand, mValue)));
            }
            return 0;
        });
    }

    // IPluginV3OneRuntime
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* /* outputDesc */,
        void const* const* inputs, void* const* outputs, void* /* workspace */, cudaStream_t stream) noexcept override
    {
        return guarded([&]() -> int32_t {
            int64_t const B = inputDesc[0].dims.d[0];
            KernelSpec const* spec = specFor(inputDesc);
            if (spec == nullptr)
            {
                return -1;
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
            return launched(r, "match", spec->name);
        });
    }
};

} // namespace

IPluginCreatorInterface* matchCreator() noexcept
{
    return creatorInstance<MatchPlugin>();
}

} // namespace trt
} // namespace macattn
