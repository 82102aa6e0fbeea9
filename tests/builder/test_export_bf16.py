"""``macattn build`` (default ``--dtype bf16``): a strongly typed bf16 graph whose MAC nodes take the rings
straight from the graph inputs (no cast in front of an aliased ring), what ONNX Runtime's CPU provider can
execute of it, and its fp32 widening executed in ONNX Runtime = the torch model on the same bf16 weights."""
import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")

import onnx  # noqa: E402
from onnx import TensorProto as T, helper as h  # noqa: E402

from macattn.builder.export import RING_NAMES  # noqa: E402
from macattn.builder.onnx_ort import bf16_tensor_names, widen_bf16  # noqa: E402
from macattn.cli import main  # noqa: E402
from macattn.models.attention import patch_model  # noqa: E402
from macattn.models.builtin import build_builtin_model  # noqa: E402
from macattn.models.transformers_api import CACHE_KWARG, returned_cache  # noqa: E402
from test_export_onnx import MAC_ON, N, SMALL, _decode_and_compare  # noqa: E402


@pytest.fixture(scope="module")
def bf16_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_bf16")
    build_builtin_model("llama", seed=11, **SMALL).save_pretrained(root / "src")
    rc = main(["build", "--model", "llama", "--from", str(root / "src"), "--out", str(root / "out"),
               "--tau", "0.0", "--window", "16", "--band", "4", "--no-progress"])      # no --dtype: bf16
    assert rc == 0
    return root / "out"


def test_default_build_is_bf16_and_strongly_typed(bf16_engine):
    assert json.loads((bf16_engine / "manifest.json").read_text())["export_dtype"] == "bf16"
    model = onnx.load(str(bf16_engine / "decode.onnx"))
    g = model.graph
    ty = {v.name: v.type.tensor_type.elem_type for v in (*g.input, *g.output)}
    for l in range(N):
        assert (ty[f"key.{l}"], ty[f"value.{l}"], ty[f"qring.{l}"]) == (T.BFLOAT16,) * 3
        assert (ty[f"oring.{l}"], ty[f"ring_lse.{l}"], ty[f"ring_pos.{l}"]) == (T.FLOAT, T.FLOAT, T.INT64)
        assert ty[f"qring.{l}.out"] == T.BFLOAT16
    assert ty["logits"] == T.FLOAT
    weights = [t for t in g.initializer if t.name.endswith("weight")]
    assert weights and {t.data_type for t in weights} == {T.BFLOAT16}
    produced_by_cast = {o for n in g.node if n.op_type == "Cast" for o in n.output}
    graph_inputs, graph_outputs = {v.name for v in g.input}, {v.name for v in g.output}
    for node in g.node:
        if node.op_type == "MacAttend":
            rings, outs = list(node.input[7:]), list(node.output[1:])
            assert set(rings) <= graph_inputs and not set(rings) & produced_by_cast      # rings straight in
            assert set(outs) <= graph_outputs                                             # and straight out
            assert [r.split(".")[0] for r in rings] == list(RING_NAMES)


@pytest.mark.parametrize("op,n_in", [("MatMul", 2), ("Mul", 2), ("Add", 2), ("Sigmoid", 1), ("Cast", 1)])
def test_what_onnx_runtime_cpu_runs_in_bf16(op, n_in):
    """The reason ``ort_session`` widens: ORT's CPU provider has bf16 kernels for casts, not arithmetic."""
    ins = [h.make_tensor_value_info(f"x{i}", T.BFLOAT16, [2, 2]) for i in range(n_in)]
    out = h.make_tensor_value_info("y", T.FLOAT if op == "Cast" else T.BFLOAT16, None)
    node = h.make_node(op, [i.name for i in ins], ["y"], **({"to": T.FLOAT} if op == "Cast" else {}))
    m = h.make_model(h.make_graph([node], "g", ins, [out]), opset_imports=[h.make_opsetid("", 18)])
    if op == "Cast":
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    else:
        with pytest.raises(Exception, match="(?i)NOT_IMPLEMENTED|implementation"):
            ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def test_bf16_graph_in_onnx_runtime_as_fp32_widening(bf16_engine):
    from transformers import AutoModelForCausalLM

    model = onnx.load(str(bf16_engine / "decode.onnx"))
    assert bf16_tensor_names(model) and not bf16_tensor_names(widen_bf16(model))
    # the reference: the same weights rounded to bf16 (what the graph stores), computed in fp32
    ref = AutoModelForCausalLM.from_pretrained(bf16_engine / "hf", attn_implementation="sdpa")
    ref = ref.to(torch.bfloat16).float().eval()
    patch_model(ref, MAC_ON)
    _decode_and_compare(ref, bf16_engine / "decode.onnx", prefill_path=bf16_engine / "prefill.onnx")


def test_graph_decoder_loop_over_the_engine_dir_graphs(bf16_engine):
    """``runtime.plan_runner.GraphDecoder`` (the loop a ``.plan`` runs through) over ONNX Runtime step functions of
    the same directory = the torch model's greedy decode (prefill token + 5 steps, 2 requests)."""
    import dataclasses

    from transformers import AutoModelForCausalLM

    from macattn.builder.onnx_ort import ort_session, run_session
    from macattn.runtime.plan_runner import GraphDecoder, GraphShapes

    shapes = GraphShapes.from_engine_dir(bf16_engine)
    assert shapes.dtype == torch.bfloat16 and shapes.windows == (16,) * N
    pre, dec = ort_session(bf16_engine / "prefill.onnx"), ort_session(bf16_engine / "decode.onnx")
    widened = dataclasses.replace(shapes, dtype=torch.float32)         # what the fp32 widening takes
    loop = GraphDecoder(lambda f: run_session(pre, f), lambda f: run_session(dec, f), widened, num_slots=3)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(3))
    got = loop.generate(ids, 6)
    ref = AutoModelForCausalLM.from_pretrained(bf16_engine / "hf", attn_implementation="sdpa")
    ref = ref.to(torch.bfloat16).float().eval()
    patch_model(ref, MAC_ON)
    want = []
    with torch.no_grad():
        out = ref(input_ids=ids, use_cache=True)
        pkv, tok = returned_cache(out), out.logits[:, -1].argmax(-1)
        want.append(tok)
        for _ in range(5):
            out = ref(input_ids=tok.view(2, 1), **{CACHE_KWARG: pkv}, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            want.append(tok)
    assert torch.equal(got, torch.stack(want, 1))
    with pytest.raises(ValueError, match="batch 4 exceeds num_slots=3"):
        loop.generate(torch.zeros(4, 5, dtype=torch.int64), 2)


def test_plan_runner_import_guard_names_tensorrt(monkeypatch):
    import sys

    from macattn.runtime.plan_runner import TensorRTPlan, require_tensorrt_runtime

    monkeypatch.setitem(sys.modules, "tensorrt", None)          # import tensorrt -> ImportError
    with pytest.raises(ImportError, match=r"`tensorrt` Python package \(>= 10\.3"):
        require_tensorrt_runtime()
    with pytest.raises(ImportError, match="tensorrt"):
        TensorRTPlan("decode.plan")
    import types
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.2.0"))
    with pytest.raises(ImportError, match=r"tensorrt >= 10\.3; found tensorrt 10\.2\.0"):
        require_tensorrt_runtime()
