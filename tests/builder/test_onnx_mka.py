"""ONNX lowering of the FastMKA decode op: one ``macattn::RouteFusedAttention`` node."""
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

from macattn.builder.onnx_ops_mka import (INPUTS, OUTPUTS, ROUTE_FUSED, custom_translation_table_mka,  # noqa: E402
                                          register_onnx_schemas_mka, route_fused_attention_functional)
from macattn.methods.mka.reference import route_fused_decode_reference  # noqa: E402


class _Step(torch.nn.Module):
    def forward(self, *args):
        return torch.ops.macattn.route_fused_attention_functional(*args, 1, 0.75)


def _inputs(B=2, D=16, Dq=12, R=4, N=8, S=3):
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(B, D), r(B, Dq), r(R, Dq), r(R), r(3, R), r(3), torch.tensor(0.5), r(S, D),
            torch.tensor([0, 4, 2]), torch.tensor([2, 0]), r(N, D), r(N), r(N, D), r(N))


def test_functional_twin_leaves_inputs_alone_and_matches_reference():
    args = _inputs()
    before = [a.clone() for a in args]
    k, v, lam, m, c = route_fused_attention_functional(*args, 1, 0.75)
    for a, b in zip(args, before):
        assert torch.equal(a, b)
    sm, sc = before[7].clone(), before[8].clone()
    rk, rv, rl = route_fused_decode_reference(*before[:7], sm, sc, *before[9:], 1, 0.75)
    torch.testing.assert_close(k, rk)
    torch.testing.assert_close(m, sm)
    assert torch.equal(c, sc) and c.tolist() == [1, 4, 3]


def test_export_emits_one_route_fused_node(tmp_path):
    register_onnx_schemas_mka()
    path = tmp_path / "mka.onnx"
    torch.onnx.export(_Step().eval(), _inputs(), str(path), dynamo=True, custom_translation_table=custom_translation_table_mka(),
                      input_names=list(INPUTS), output_names=list(OUTPUTS))
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.op_type == ROUTE_FUSED]
    assert len(nodes) == 1 and nodes[0].domain == "macattn"
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["mode"] == 1 and attrs["beta"] == pytest.approx(0.75)
    assert len(nodes[0].input) == len(INPUTS) and len(nodes[0].output) == len(OUTPUTS)
    onnx.checker.check_model(model)


def test_plugin_output_specs_and_errors():
    from macattn.plugins.route_fused.plugin import route_fused_output_specs

    args = _inputs()
    shapes = [tuple(a.shape) for a in args]
    dtypes = [a.dtype for a in args]
    specs = route_fused_output_specs(shapes, dtypes, mode=1, beta=0.75)
    k, v, lam, m, c = route_fused_attention_functional(*args, 1, 0.75)
    assert specs == [(tuple(t.shape), t.dtype) for t in (k, v, lam, m, c)]
    bad = list(shapes)
    bad[11] = (7,)
    with pytest.raises(ValueError, match="bk"):
        route_fused_output_specs(bad, dtypes, mode=1, beta=0.75)
    bad_dt = list(dtypes)
    bad_dt[8] = torch.int32
    with pytest.raises(TypeError, match="state_count"):
        route_fused_output_specs(shapes, bad_dt, mode=0, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        route_fused_output_specs(shapes, dtypes, mode=1, beta=1.5)


def test_plugin_registration_needs_tensorrt():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        from macattn.plugins.tensorrt_plugins import register_all
        with pytest.raises(ImportError, match="tensorrt"):
            register_all()
    else:
        pytest.skip("tensorrt is installed here")
