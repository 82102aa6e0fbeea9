// TensorRT plugin mac::attend (version "1"), IPluginV3 over the macattn_kernels C library.
//
// Contract: docs/graph.md (MacAttend). Inputs q, q_pre [B,Hq,d], k, v [B,Hkv,T,d], positions [B] i64,
// match_pos [B,Hq] i64, slots [B] i64, qring [S,Hq,K,d], oring [S,Hq,K,d] f32, ring_lse [S,Hq,K] f32,
// ring_pos [S,K] i64; outputs out [B,Hq,d] (q's dtype) and qring_out, oring_out, ring_lse_out,
// ring_pos_out, each aliased to its ring input (IPluginV3OneBuildV2::getAliasedInput; TensorRT honours
// it when the builder config enables PreviewFeature::kALIASED_PLUGIN_IO_10_03). Fields band (int32 /
// int64), scale (float32). Shape/dtype inference mirrors attend_output_specs in
// plugins/mac/attend_plugin.py; the compiled kernels are bf16 (q, q_pre, k, v, qring); enqueue
// dispatches on (Hq, Hkv, d, K, band, scale).
#include "../trt_plugin_common.h"

#include <cmath>
#include <limits>
#include <sstream>

using namespace nvinfer1;

namespace macattn {
namespace trt {
namespace {

constexpr int32_t kNbInputs = 11;
constexpr int32_t kNbOutputs = 5;
enum Input : int32_t
{
    kQ = 0,
    kQPre,
    kK,
    kV,
    kPositions,
    kMatchPos,
    kSlots,
    kQring,
    kOring,
    kRingLse,
    kRingPos
};
constexpr char const* kInputNames[kNbInputs]
    = {"q", "q_pre", "k", "v", "positions", "match_pos", "slots", "qring", "oring", "ring_lse", "ring_pos"};
constexpr int32_t kRanks[kNbInputs] = {3, 3, 4, 4, 1, 2, 1, 4, 4, 3, 2};
// Output i >= 1 aliases input kAliasOf[i] (the rings, appended in place); out (0) aliases nothing.
constexpr int32_t kAliasOf[kNbOutputs] = {-1, kQring, kOring, kRingLse, kRingPos};

// Formats TensorRT may pick: what the compiled kernels take (11 inputs, then 5 outputs).
constexpr DataType kIoTypes[kNbInputs + kNbOutputs] = {DataType::kBF16, DataType::kBF16, DataType::kBF16,
    DataType::kBF16, DataType::kINT64, DataType::kINT64, DataType::kINT64, DataType::kBF16, DataType::kFLOAT,
    DataType::kFLOAT, DataType::kINT64,
    // outputs: out, qring_out, oring_out, ring_lse_out, ring_pos_out
    DataType::kBF16, DataType::kBF16, DataType::kFLOAT, DataType::kFLOAT, DataType::kINT64};

KernelSpec const* findSpec(int64_t hq, int64_t hkv, int64_t d, int64_t k, int64_t band, float scale) noexcept
{
    for (KernelSpec const& s : kernelSpecs())
    {
        if (s.hq == hq && s.hkv == hkv && s.d == d && s.k == k && s.band == band && specScale(s.d) == scale)
        {
            return &s;
        }
    }
    return nullptr;
}

std::string wanted(int64_t hq, int64_t hkv, int64_t d, int64_t k, int64_t band, float scale)
{
    std::ostringstream os;
    os << "Hq=" << hq << ", Hkv=" << hkv << ", d=" << d << ", K=" << k << ", band=" << band << ", scale=" << scale;
    return os.str();
}

class AttendPlugin : public PluginBase<AttendPlugin, IPluginV3OneBuildV2>
{
public:
    static constexpr PluginTraits kTraits{"attend", "scale", kNbInputs, kNbOutputs, kRanks, kInputNames, kIoTypes};

    using PluginBase::PluginBase;

    static std::string checkValue(float scale)
    {
        std::ostringstream os;
        if (!(std::isfinite(scale) && scale > 0.0f))
        {
            os << "mac::attend: scale must be a finite float > 0, got " << scale;
        }
        return os.str();
    }

    // The compiled specialisation for the runtime shapes ``in`` (nullptr and ``err`` set if none).
    KernelSpec const* lookup(PluginTensorDesc const* in, std::string& err) const
    {
        int64_t const hq = in[kQ].dims.d[1], d = in[kQ].dims.d[2];
        int64_t const hkv = in[kK].dims.d[1], k = in[kQring].dims.d[2];
        KernelSpec const* spec = findSpec(hq, hkv, d, k, mBand, mValue);
        if (spec == nullptr)
        {
            err = noSpecMessage("attend", wanted(hq, hkv, d, k, mBand, mValue));
        }
        return spec;
    }

    // IPluginV3OneBuildV2
    int32_t getAliasedInput(int32_t outputIndex) noexcept override
    {
        return outputIndex >= 0 && outputIndex < kNbOutputs ? kAliasOf[outputIndex] : -1;
    }

    // IPluginV3OneBuild
    int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
        int32_t nbInputs) const noexcept override
    {
        return guarded([&]() -> int32_t {
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
            {
                return fail("mac::attend takes 11 inputs and gives 5 outputs, got " + std::to_string(nbInputs) + " / "
                    + std::to_string(nbOutputs));
            }
            for (int32_t i : {kQ, kQPre, kK, kV, kQring})
            {
                if (!isFloatType(inputTypes[i]))
                {
                    return fail(std::string("mac::attend: ") + kInputNames[i] + " must be float32/float16/bfloat16, got "
                        + dataTypeName(inputTypes[i]));
                }
            }
            if (!(inputTypes[kQ] == inputTypes[kK] && inputTypes[kK] == inputTypes[kV]))
            {
                return fail(std::string("mac::attend: q, k and v must share a dtype, got ") + dataTypeName(inputTypes[kQ])
                    + ", " + dataTypeName(inputTypes[kK]) + ", " + dataTypeName(inputTypes[kV]));
            }
            struct Want
            {
                int32_t input;
                DataType type;
            };
            Want const wants[] = {{kPositions, DataType::kINT64}, {kMatchPos, DataType::kINT64},
                {kSlots, DataType::kINT64}, {kOring, DataType::kFLOAT}, {kRingLse, DataType::kFLOAT},
                {kRingPos, DataType::kINT64}};
            for (Want const& w : wants)
            {
                if (inputTypes[w.input] != w.type)
                {
                    return fail(std::string("mac::attend: ") + kInputNames[w.input] + " must be " + dataTypeName(w.type)
                        + ", got " + dataTypeName(inputTypes[w.input]));
                }
            }
            outputTypes[0] = inputTypes[kQ];
            for (int32_t o = 1; o < kNbOutputs; ++o)
            {
                outputTypes[o] = inputTypes[kAliasOf[o]];
            }
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
            // q [B, Hq, d]; k [B, Hkv, T, d]; qring [S, Hq, K, d]
            IDimensionExpr const* B = inputs[kQ].d[0];
            IDimensionExpr const* Hq = inputs[kQ].d[1];
            IDimensionExpr const* d = inputs[kQ].d[2];
            IDimensionExpr const* Hkv = inputs[kK].d[1];
            IDimensionExpr const* T = inputs[kK].d[2];
            IDimensionExpr const* S = inputs[kQring].d[0];
            IDimensionExpr const* K = inputs[kQring].d[2];
            if (checkDims(inputs, {{kQPre, {B, Hq, d}}, {kK, {B, Hkv, T, d}}, {kV, {B, Hkv, T, d}}, {kPositions, {B}},
                {kMatchPos, {B, Hq}}, {kSlots, {B}}, {kQring, {S, Hq, K, d}}, {kOring, {S, Hq, K, d}},
                              {kRingLse, {S, Hq, K}}, {kRingPos, {S, K}}},
                    "q [B, Hq, d], k [B, Hkv, T, d], qring [S, Hq, K, d]")
                != 0)
            {
                return -1;
            }
            if (Hq->isConstant() && Hkv->isConstant())
            {
                int64_t const hq = Hq->getConstantValue(), hkv = Hkv->getConstantValue();
                if (hkv < 1 || hq % hkv != 0)
                {
                    return fail("mac::attend: query heads Hq=" + std::to_string(hq)
                        + " must be a multiple of KV heads Hkv=" + std::to_string(hkv));
                }
            }
            outputs[0] = inputs[kQ];   // out [B, Hq, d]
            for (int32_t o = 1; o < kNbOutputs; ++o)
            {
                outputs[o] = inputs[kAliasOf[o]];   // each ring as its input
            }
            return 0;
        });
    }

    int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* /* out */,
        int32_t nbOutputs) noexcept override
    {
        return guarded([&]() -> int32_t {
            if (nbInputs != kNbInputs || nbOutputs != kNbOutputs)
            {
                return fail("mac::attend: wrong number of inputs/outputs");
            }
            // Hq, Hkv, d, K are constexprs of the kernels: static in the graph (-1 = dynamic).
            int64_t const hq = in[kQ].desc.dims.d[1], d = in[kQ].desc.dims.d[2];
            int64_t const hkv = in[kK].desc.dims.d[1], k = in[kQring].desc.dims.d[2];
            if (hq < 0 || hkv < 0 || d < 0 || k < 0)
            {
                return fail("mac::attend: Hq, Hkv, d and K must be build-time constants, got q "
                    + dimsToString(in[kQ].desc.dims) + ", k " + dimsToString(in[kK].desc.dims) + ", qring "
                    + dimsToString(in[kQring].desc.dims));
            }
            if (findSpec(hq, hkv, d, k, mBand, mValue) == nullptr)
            {
                return fail(noSpecMessage("attend", wanted(hq, hkv, d, k, mBand, mValue)));
            }
            return 0;
        });
    }

    // IPluginV3OneRuntime
    int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
        void* const* outputs, void* /* workspace */, cudaStream_t stream) noexcept override
    {
        return guarded([&]() -> int32_t {
            int64_t const B = inputDesc[kQ].dims.d[0], T = inputDesc[kK].dims.d[2];
            KernelSpec const* spec = specFor(inputDesc);
            if (spec == nullptr)
            {
                return -1;
            }
            int64_t const i32max = std::numeric_limits<int32_t>::max();
            if (B < 0 || B > i32max || T < 0 || T > i32max)
            {
                return fail("mac::attend: B=" + std::to_string(B) + " / T=" + std::to_string(T)
                    + " do not fit the kernel's int32");
            }
            // The kernel writes only the appended entry of each ring (row slots[b], column positions[b] mod K).
            // When TensorRT did not alias a ring output to its input (preview feature off, or a copy it
            // inserted), carry the rest of the ring over first, on the same stream.
            for (int32_t o = 1; o < kNbOutputs; ++o)
            {
                int32_t const i = kAliasOf[o];
                if (outputs[o] != inputs[i])
                {
                    size_t const bytes = static_cast<size_t>(volume(inputDesc[i].dims)) * elementSize(inputDesc[i].type);
                    if (volume(outputDesc[o].dims) != volume(inputDesc[i].dims))
                    {
                        return fail(std::string("mac::attend: output ") + std::to_string(o) + " does not have the shape of "
                            + kInputNames[i]);
                    }
                    cudaError_t const e = cudaMemcpyAsync(outputs[o], inputs[i], bytes, cudaMemcpyDeviceToDevice, stream);
                    if (e != cudaSuccess)
                    {
                        return fail(std::string("mac::attend: copying ") + kInputNames[i] + " to its output failed: "
                            + cudaGetErrorString(e));
                    }
                }
            }
            if (B == 0)
            {
                return 0;   // empty grid: nothing to launch (the Triton launcher has no return for it)
            }
            auto ptr = [](void const* p) { return reinterpret_cast<CUdeviceptr>(p); };
            CUresult const r = spec->attend(reinterpret_cast<CUstream>(stream), ptr(inputs[kQ]), ptr(inputs[kQPre]),
                ptr(inputs[kK]), ptr(inputs[kV]), ptr(inputs[kPositions]), ptr(inputs[kMatchPos]), ptr(inputs[kSlots]),
                ptr(inputs[kQring]), ptr(inputs[kOring]), ptr(inputs[kRingLse]), ptr(inputs[kRingPos]),
                static_cast<int32_t>(B), static_cast<int32_t>(T), ptr(outputs[0]), ptr(outputs[1]), ptr(outputs[2]),
                ptr(outputs[3]), ptr(outputs[4]));
            return launched(r, "attend", spec->name);
        });
    }
};

} // namespace

IPluginCreatorInterface* attendCreator() noexcept
{
    return creatorInstance<AttendPlugin>();
}

} // namespace trt
} // namespace macattn
