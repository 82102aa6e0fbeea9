"""ONNX lowering of retrieval-completion: ``macattn::CompletionCache`` + ``macattn::RetrievalCompletion``
nodes, executed in ONNX Runtime (nodes bound to the torch ops) and compared with the reference;
the TensorRT plugin definitions' shape/dtype inference."""
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from macattn.builder.onnx_ops_completion import (COMPLETION_CACHE, RETRIEVAL_COMPLETION,  # noqa: E402
                                                 custom_translation_table_completion,
                                                 register_onnx_schemas_completion)
from macattn.methods.completion.reference import build_completion_cache_batched, retrieval_completion_step  # noqa: E402
from macattn.plugins.retrieval_completion.plugin import (CACHE_INPUTS, STEP_INPUTS,  # noqa: E402
                                                         completion_cache_output_specs,
                                                         retrieval_completion_output_specs)

INPUTS = ("q", "k_cache", "v_cache", "seq_lens", "n_prefill", "log_phi_q", "log_phi_k")


class _PrefillThenStep(torch.nn.Module):
    """Build the cache from the prefill rows, then one decode step (n_sink 2, n_tail 3, top_k 4)."""

    def forward(self, q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k):
        a, b, c = torch.ops.macattn.completion_cache(log_phi_k, v_cache, n_prefill, 2, 3)
        return torch.ops.macattn.retrieval_completion(q, k_cache, v_cache, seq_lens, n_prefill, log_phi_q, log_phi_k,
                                                      a, b, c, 2, 3, 4, 0.0)


def _inputs(seed, B=2, Hq=4, Hkv=2, T=30, d=8, F=6):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(B, Hq, d), r(B, Hkv, T, d), r(B, Hkv, T, d), torch.tensor([30, 9][:B]), torch.tensor([26, 8][:B]),
            r(B, Hq, F) * 0.5, r(B, Hkv, T, F) * 0.5)


def _export(path):
    register_onnx_schemas_completion()
    torch.onnx.export(_PrefillThenStep().eval(), _inputs(0), str(path), dynamo=True,
                      custom_translation_table=custom_translation_table_completion(), input_names=list(INPUTS),
                      output_names=["out"])
    return onnx.load(str(path))


def test_export_emits_one_node_each_with_attributes(tmp_path):
    model = _export(tmp_path / "rc.onnx")
    ops = {n.op_type: n for n in model.graph.node if n.domain == "macattn"}
    assert set(ops) == {RETRIEVAL_COMPLETION, COMPLETION_CACHE}
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ops[RETRIEVAL_COMPLETION].attribute}
    assert attrs["n_sink"] == 2 and attrs["n_tail"] == 3 and attrs["top_k"] == 4 and attrs["scale"] == 0.0
    assert len(ops[RETRIEVAL_COMPLETION].input) == len(STEP_INPUTS) and len(ops[COMPLETION_CACHE].output) == 3
    onnx.checker.check_model(model, full_check=True)


def test_onnx_runtime_runs_the_graph_like_the_reference(tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxruntime_extensions")
    from macattn.builder.onnx_ort import ort_session, run_session

    _export(tmp_path / "rc.onnx")
    sess = ort_session(tmp_path / "rc.onnx")
    for seed in (1, 2):                      # fresh inputs, not the ones traced at export
        x = _inputs(seed)
        got = run_session(sess, dict(zip(INPUTS, x)))["out"]
        q, k, v, sl, npf, lpq, lpk = x
        comp = build_completion_cache_batched(lpk, v, npf, n_sink=2, n_tail=3)
        ref = retrieval_completion_step(q, k, v, sl, npf, lpq, lpk, *comp, n_sink=2, n_tail=3, top_k=4)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_plugin_output_specs_match_the_ops_and_name_bad_inputs():
    x = _inputs(3)
    q, k, v, sl, npf, lpq, lpk = x
    comp = torch.ops.macattn.completion_cache(lpk, v, npf, 2, 3)
    cache_specs = completion_cache_output_specs([tuple(t.shape) for t in (lpk, v, npf)],
                                                [lpk.dtype, v.dtype, npf.dtype], n_sink=2, n_tail=3)
    assert cache_specs == [(tuple(t.shape), t.dtype) for t in comp]
    ins = (*x[:7], *comp)
    shapes, dtypes = [tuple(t.shape) for t in ins], [t.dtype for t in ins]
    out = torch.ops.macattn.retrieval_completion(*ins, 2, 3, 4, 0.0)
    assert retrieval_completion_output_specs(shapes, dtypes, n_sink=2, n_tail=3, top_k=4, scale=0.0) == [
        (tuple(out.shape), out.dtype)]
    bad = list(shapes)
    bad[STEP_INPUTS.index("comp_b")] = (2, 2, 5)
    with pytest.raises(ValueError, match="comp_b"):
        retrieval_completion_output_specs(bad, dtypes, n_sink=2, n_tail=3, top_k=4, scale=0.0)
    bad_dt = list(dtypes)
    bad_dt[STEP_INPUTS.index("v_cache")] = torch.bfloat16
    with pytest.raises(TypeError, match="k_cache and v_cache"):
        retrieval_completion_output_specs(shapes, bad_dt, n_sink=2, n_tail=3, top_k=4, scale=0.0)
    with pytest.raises(ValueError, match="top_k"):
        retrieval_completion_output_specs(shapes, dtypes, n_sink=2, n_tail=3, top_k=-1, scale=0.0)
    bad_q = list(shapes)
    bad_q[0] = (2, 3, 8)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        retrieval_completion_output_specs(bad_q, dtypes, n_sink=2, n_tail=3, top_k=4, scale=0.0)
    with pytest.raises(TypeError, match="log_phi_k"):
        completion_cache_output_specs([tuple(t.shape) for t in (lpk, v, npf)], [torch.float16, v.dtype, npf.dtype],
                                      n_sink=2, n_tail=3)
    assert CACHE_INPUTS == ("log_phi_k", "v_cache", "n_prefill")
