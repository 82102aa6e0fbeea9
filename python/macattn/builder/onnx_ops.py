"""The ``macattn`` ONNX domain: op schemas, exporter translations, and the functional attend op.

Two custom nodes (``docs/graph.md`` is the contract, shared with the TensorRT plugins
``mac::match`` / ``mac::attend`` and the runtime):

* ``macattn::MacMatch`` (opset ``macattn`` v1) <- ``torch.ops.macattn.mac_match``
* ``macattn::MacAttend`` (opset ``macattn`` v1) <- ``torch.ops.macattn.mac_attend``

``mac_attend`` mutates its four ring arguments. ``torch.export`` functionalises that
into one ``auto_functionalized_v2`` node per call, which the ONNX exporter cannot
translate; ``replace_auto_functionalized`` rewrites each such node into one call of
``macattn::mac_attend_functional`` (this module), which returns ``(out, qring', oring',
ring_lse', ring_pos')`` without mutating, and which translates to one ``MacAttend``
node with five outputs. The ring outputs are the updated rings (ONNX is SSA: the
in-place update becomes an input -> output pair, e.g. ``qring.3`` -> ``qring.3.out``).
"""
from __future__ import annotations

import onnx
import torch
from onnx.defs import OpSchema

from macattn.methods.mac import ops  # noqa: F401  (registers torch.ops.macattn.mac_match / mac_attend)

__all__ = ["DOMAIN", "DOMAIN_VERSION", "MAC_MATCH", "MAC_ATTEND", "RING_ARGS", "register_onnx_schemas",
           "custom_translation_table", "replace_auto_functionalized", "replace_inplace_attend",
           "mac_attend_functional"]

DOMAIN = "macattn"
DOMAIN_VERSION = 1
MAC_MATCH = "MacMatch"
MAC_ATTEND = "MacAttend"
RING_ARGS = ("qring", "oring", "ring_lse", "ring_pos")

FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]   # type constraints of float inputs


# --- the functional twin of mac_attend (export only) --------------------------------------
@torch.library.custom_op("macattn::mac_attend_functional", mutates_args=())
def mac_attend_functional(q: torch.Tensor, q_pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, match_pos: torch.Tensor, slots: torch.Tensor,
                          qring: torch.Tensor, oring: torch.Tensor, ring_lse: torch.Tensor,
                          ring_pos: torch.Tensor, band: int, scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mac_attend`` on copies of the rings: ``(out [B, Hq, d], qring', oring', ring_lse', ring_pos')``."""
    rings = [r.clone() for r in (qring, oring, ring_lse, ring_pos)]
    out = torch.ops.macattn.mac_attend(q, q_pre, k, v, positions, match_pos, slots, *rings, band, scale)
    return (out, *rings)


@mac_attend_functional.register_fake
def _(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos, band, scale):
    return (torch.empty_like(q), torch.empty_like(qring), torch.empty_like(oring), torch.empty_like(ring_lse),
            torch.empty_like(ring_pos))


# --- ONNX schemas ---------------------------------------------------------------------------
def _param(name: str, type_str: str, doc: str) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(name, type_str, doc)


def _schemas() -> list[OpSchema]:
    types = [("T", FLOAT_TYPES, "query dtype"), ("TQ", FLOAT_TYPES, "qring dtype"),
             ("TKV", FLOAT_TYPES, "K/V dtype"), ("TO", FLOAT_TYPES, "oring dtype")]
    match = OpSchema(
        MAC_MATCH, DOMAIN, DOMAIN_VERSION,
        doc="MAC match step (docs/graph.md): nearest pre-RoPE query in the window, threshold and validity.",
        inputs=[_param("q_pre", "T", "[B, Hq, d]"), _param("qring", "TQ", "[S, Hq, K, d]"),
                _param("ring_lse", "tensor(float)", "[S, Hq, K]"), _param("ring_pos", "tensor(int64)", "[S, K]"),
                _param("slots", "tensor(int64)", "[B]"), _param("positions", "tensor(int64)", "[B]")],
        outputs=[_param("match_pos", "tensor(int64)", "[B, Hq], -1 = miss"),
                 _param("dist", "tensor(float)", "[B, Hq]")],
        type_constraints=[t for t in types if t[0] in ("T", "TQ")],
        attributes=[OpSchema.Attribute("band", OpSchema.AttrType.INT, "rectification band r >= 0"),
                    OpSchema.Attribute("tau", OpSchema.AttrType.FLOAT, "threshold in [0, 1)")])
    attend = OpSchema(
        MAC_ATTEND, DOMAIN, DOMAIN_VERSION,
        doc="MAC complete + amend + ring append (docs/graph.md). Ring outputs are the updated rings and "
            "may alias the ring inputs (in place).",
        inputs=[_param("q", "T", "[B, Hq, d] post-RoPE"), _param("q_pre", "T", "[B, Hq, d] pre-RoPE"),
                _param("k", "TKV", "[B, Hkv, T, d]"), _param("v", "TKV", "[B, Hkv, T, d]"),
                _param("positions", "tensor(int64)", "[B]"), _param("match_pos", "tensor(int64)", "[B, Hq]"),
                _param("slots", "tensor(int64)", "[B]"), _param("qring", "TQ", "[S, Hq, K, d]"),
                _param("oring", "TO", "[S, Hq, K, d]"), _param("ring_lse", "tensor(float)", "[S, Hq, K]"),
                _param("ring_pos", "tensor(int64)", "[S, K]")],
        outputs=[_param("out", "T", "[B, Hq, d]"), _param("qring_out", "TQ", "[S, Hq, K, d]"),
                 _param("oring_out", "TO", "[S, Hq, K, d]"), _param("ring_lse_out", "tensor(float)", "[S, Hq, K]"),
                 _param("ring_pos_out", "tensor(int64)", "[S, K]")],
        type_constraints=types,
        attributes=[OpSchema.Attribute("band", OpSchema.AttrType.INT, "rectification band r >= 0"),
                    OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "softmax scale, 1/sqrt(d) usually")])
    return [match, attend]


def register_schemas(schemas) -> None:
    """Register ``schemas`` with ``onnx.defs`` unless already there (idempotent)."""
    for schema in schemas:
        if not onnx.defs.has(schema.name, schema.domain):
            onnx.defs.register_schema(schema)


def register_onnx_schemas() -> None:
    """Register the ``macattn`` op schemas with ``onnx.defs`` (idempotent) so the checker and
    strict shape inference know the ops. Shape inference of these nodes is not in the
    schema (onnx's Python API cannot attach one); the exporter writes every output's
    type and shape as ``value_info``."""
    register_schemas(_schemas())


# --- torch.onnx translations (onnxscript, traced by the exporter) --------------------------
def custom_translation_table() -> dict:
    """``{torch op: onnxscript function}`` for ``torch.onnx.export(..., custom_translation_table=...)``."""
    import onnxscript

    register_onnx_schemas()
    opset = onnxscript.values.Opset(DOMAIN, DOMAIN_VERSION)

    def mac_match_onnx(q_pre, qring, ring_lse, ring_pos, slots, positions, band: int, tau: float):
        return opset.MacMatch(q_pre, qring, ring_lse, ring_pos, slots, positions, band=band, tau=tau)

    def mac_attend_onnx(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos,
                        band: int, scale: float):
        return opset.MacAttend(q, q_pre, k, v, positions, match_pos, slots, qring, oring, ring_lse, ring_pos,
                               band=band, scale=scale)

    return {torch.ops.macattn.mac_match.default: mac_match_onnx,
            torch.ops.macattn.mac_attend_functional.default: mac_attend_onnx}


# --- auto_functionalized -> mac_attend_functional ------------------------------------------
_AF_KEYS = {f"_{a}_base_index" for a in RING_ARGS} | {"_all_bases"}


def replace_auto_functionalized(ep: torch.export.ExportedProgram) -> int:
    """Rewrite, in place, every ``auto_functionalized(_v2)(macattn.mac_attend, ...)`` node of a
    functional ``ep`` (after ``run_decompositions``) into ``macattn.mac_attend_functional``.

    Output ``0`` stays the attention output; output ``1 + i`` (new value of base ``i``)
    becomes the functional op's output for the ring argument whose base is ``i``.
    Returns the number of nodes replaced. Rings passed as views are not supported.
    """
    from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

    gm = ep.graph_module
    graph = gm.graph
    target_op = torch.ops.macattn.mac_attend.default
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (auto_functionalized, auto_functionalized_v2):
            continue
        if node.args[0] is not target_op:
            continue
        kw = dict(node.kwargs)
        if node.target is auto_functionalized_v2:
            extra = {k for k in kw if k.startswith("_")} - _AF_KEYS
            if extra:
                raise NotImplementedError(f"mac_attend rings passed as views ({sorted(extra)}); pass whole tensors")
            bases = kw["_all_bases"]
            rings = [bases[kw[f"_{a}_base_index"]] for a in RING_ARGS]
            out_index = {1 + kw[f"_{a}_base_index"]: 1 + j for j, a in enumerate(RING_ARGS)}
        else:  # v1: outputs are (out, *mutated args in declaration order)
            rings = [kw[a] for a in RING_ARGS]
            out_index = {1 + j: 1 + j for j in range(len(RING_ARGS))}
        out_index[0] = 0
        args = [kw[n] for n in ("q", "q_pre", "k", "v", "positions", "match_pos", "slots")] + rings
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.macattn.mac_attend_functional.default,
                                      (*args, kw["band"], kw["scale"]))
        new.meta.update(node.meta)
        if isinstance(node.meta.get("val"), (tuple, list)):
            inverse = {v: k for k, v in out_index.items()}
            new.meta["val"] = tuple(node.meta["val"][inverse[j]] for j in range(1 + len(RING_ARGS)))
        for user in list(node.users):
            if user.op == "call_function" and user.args[0] is node:
                user.args = (new, out_index[user.args[1]])
            else:
                raise NotImplementedError(f"unexpected user {user} of auto_functionalized mac_attend")
        graph.erase_node(node)
        count += 1
    graph.lint()
    gm.recompile()
    return count


def replace_inplace_attend(ep: torch.export.ExportedProgram) -> int:
    """Rewrite, in place, every ``macattn.mac_attend`` call of a *training-IR* ``ep`` (straight
    from ``torch.export.export``, rings mutated in place) into ``mac_attend_functional``.

    Later uses of each ring (including the graph outputs) are redirected to the functional
    op's ring outputs and the output specs renamed, so the program no longer mutates its
    inputs and the ONNX exporter's single ``run_decompositions`` leaves one node per call
    (saves a second functionalisation pass over the whole graph). Returns the count.
    """
    import operator

    from torch.export.graph_signature import TensorArgument

    gm = ep.graph_module
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    output = nodes[-1]
    renamed: dict[str, str] = {}
    count = 0
    for node in nodes:
        if node.op != "call_function" or node.target is not torch.ops.macattn.mac_attend.default:
            continue
        bound = node.target._schema
        names = [a.name for a in bound.arguments]
        kw = dict(zip(names, node.args))
        kw.update(node.kwargs)
        rings = [kw[a] for a in RING_ARGS]
        with graph.inserting_after(node):
            new = graph.call_function(torch.ops.macattn.mac_attend_functional.default,
                                      tuple(kw[n] for n in names))
        fake = node.meta.get("val")
        new.meta.update(node.meta)
        getters = []
        prev = new
        for j in range(1 + len(RING_ARGS)):
            with graph.inserting_after(prev):
                g = graph.call_function(operator.getitem, (new, j))
            src = fake if j == 0 else rings[j - 1].meta.get("val")
            g.meta["val"] = src
            getters.append(g)
            prev = g
        new.meta["val"] = tuple(g.meta["val"] for g in getters)
        node.replace_all_uses_with(getters[0])
        for ring, g in zip(rings, getters[1:]):
            for user in list(ring.users):
                if user is output or (user in order and order[user] > order[node]):
                    user.replace_input_with(ring, g)
                    if user is output:
                        renamed[ring.name] = g.name
        graph.erase_node(node)
        count += 1
    for spec in ep.graph_signature.output_specs:
        if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
            spec.arg = TensorArgument(name=renamed[spec.arg.name])
    graph.lint()
    gm.recompile()
    return count
