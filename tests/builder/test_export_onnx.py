"""Decode/prefill export: torch.export nodes, ONNX graph contract, ONNX Runtime vs the torch patched model.

Each family's graph runs in ONNX Runtime (custom nodes = the reference via
onnxruntime-extensions Python ops) for 8 decode steps next to the patched HF model
(``model(input_ids=tok, cache=...)``); logits, new K/V, updated rings and the
match decisions must agree.
"""
import json
import shutil
import subprocess

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")

import onnx  # noqa: E402

from macattn.builder.export import (RING_NAMES, DecodeStepModule, PrefillStepModule, decode_io_names,  # noqa: E402
                                    prefill_io_names)
from macattn.builder.onnx_export import (check_onnx, count_custom_nodes, example_decode_inputs,  # noqa: E402
                                         export_decode_onnx)
from macattn.builder.onnx_ops import replace_auto_functionalized  # noqa: E402
from macattn.builder.onnx_ort import ort_session, run_session  # noqa: E402
from macattn.models.attention import binding_of, patch_model  # noqa: E402
from macattn.cli import main  # noqa: E402
from macattn.methods.mac.config import MacConfig  # noqa: E402
from macattn.models.builtin import build_builtin_model  # noqa: E402
from macattn.models.transformers_api import CACHE_KWARG, returned_cache  # noqa: E402

SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, vocab_size=512)
N = SMALL["num_hidden_layers"]
MAC_ON = MacConfig(tau=0.0, window=16, band=4)     # tau = 0: radius sqrt(2d), hits from the first step
PROMPT, STEPS = 40, 8


def _ids(seed=7, batch=2):
    return torch.randint(0, SMALL["vocab_size"], (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _close(a, b, what, atol=1e-4):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def _decode_and_compare(model, decode_path, *, prefill_path=None, mac_on=True):
    """Prefill (HF patched model; ONNX prefill too if given) then STEPS decode steps, ONNX vs torch."""
    ctx = binding_of(model).method
    ids = _ids()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    pkv = returned_cache(out)
    slots = ctx.slots.clone()
    rings = [[t[slots].clone() for t in ctx.state.layer(l)] for l in range(N)]   # a 2-slot ring copy
    local = torch.arange(2)
    keys = [pkv.layers[l].keys.clone() for l in range(N)]
    values = [pkv.layers[l].values.clone() for l in range(N)]
    if prefill_path is not None:
        ins, outs = prefill_io_names(N)
        empty = [t.clone() for l in range(N) for t in rings[l]]
        got = run_session(ort_session(prefill_path), dict(zip(ins, [ids, local, *empty])))
        _close(got["logits"], out.logits[:, -1], "prefill logits")
        for l in range(N):
            _close(got[f"key.{l}"], keys[l], f"prefill key.{l}")
            _close(got[f"value.{l}"], values[l], f"prefill value.{l}")
            for name, ref in zip(RING_NAMES, rings[l]):
                _close(got[f"{name}.{l}.out"], ref, f"prefill {name}.{l}")
            rings[l] = [got[f"{name}.{l}.out"] for name in RING_NAMES]
    sess = ort_session(decode_path)
    ins, _ = decode_io_names(N)
    tok = out.logits[:, -1:].argmax(-1)
    hits = 0
    for step in range(STEPS):
        m = PROMPT + step
        state = [t for l in range(N) for t in (keys[l], values[l], *rings[l])]
        got = run_session(sess, dict(zip(ins, [tok, torch.full((2,), m), local, *state])))
        with torch.no_grad():
            ref = model(input_ids=tok, **{CACHE_KWARG: pkv}, use_cache=True)
        _close(got["logits"], ref.logits[:, -1], f"step {step} logits")
        for l in range(N):
            _close(got[f"key.{l}.new"], pkv.layers[l].keys[:, :, -1:], f"step {step} key.{l}.new")
            _close(got[f"value.{l}.new"], pkv.layers[l].values[:, :, -1:], f"step {step} value.{l}.new")
            for name, t in zip(RING_NAMES, ctx.state.layer(l)):
                _close(got[f"{name}.{l}.out"], t[slots], f"step {step} {name}.{l}")
            assert torch.equal(got[f"match_pos.{l}"], ctx.last_match_pos[l]), f"step {step} match_pos.{l}"
            hits += int((got[f"match_pos.{l}"] >= 0).sum())
            keys[l] = torch.cat([keys[l], got[f"key.{l}.new"]], 2)
            values[l] = torch.cat([values[l], got[f"value.{l}.new"]], 2)
            rings[l] = [got[f"{name}.{l}.out"] for name in RING_NAMES]
        tok = ref.logits[:, -1:].argmax(-1)
    if mac_on:
        assert hits > 0, "MAC on but no step hit: the comparison did not exercise the hit path"
    else:
        assert hits == 0
    return hits


# --- torch.export -------------------------------------------------------------------------
def test_torch_export_sees_one_node_per_op_and_ring_mutations():
    model = build_builtin_model("llama", seed=1, **SMALL)
    patch_model(model, MAC_ON)
    args = example_decode_inputs(model)
    with torch.no_grad():
        ep = torch.export.export(DecodeStepModule(model), args, strict=False)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.macattn.mac_match.default) == N
    assert targets.count(torch.ops.macattn.mac_attend.default) == N
    fn = ep.run_decompositions({})
    af = [n for n in fn.graph.nodes if "auto_functionalized" in str(n.target)]
    assert len(af) == N and all(n.args[0] is torch.ops.macattn.mac_attend.default for n in af)
    mutated = set(fn.graph_signature.user_inputs_to_mutate.values())
    placeholders = [n.name for n in fn.graph.nodes if n.op == "placeholder"]
    user_inputs = [p for p in placeholders if p in fn.graph_signature.user_inputs]
    ring_inputs = {user_inputs[3 + 6 * l + 2 + j] for l in range(N) for j in range(4)}
    assert mutated == ring_inputs      # exactly the 4 rings of every layer, nothing else
    assert replace_auto_functionalized(fn) == N   # the ONNX path's rewrite of those nodes
    assert not [n for n in fn.graph.nodes if "auto_functionalized" in str(n.target)]


# --- build CLI + llama: prefill and decode graphs in ONNX Runtime ---------------------------
@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model = build_builtin_model("llama", seed=11, **SMALL)
    model.save_pretrained(root / "src")
    rc = main(["build", "--model", "llama", "--from", str(root / "src"), "--out", str(root / "out"),
               "--dtype", "fp32", "--tau", "0.0", "--window", "16", "--band", "4", "--no-progress"])
    assert rc == 0
    return root / "out"


def test_build_writes_engine_dir(llama_engine, capsys):
    out = llama_engine
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == "llama" and manifest["architecture"] == "LlamaForCausalLM"
    assert manifest["mac_config"] == MAC_ON.to_dict()
    assert manifest["ops"]["onnx"] == {"mac_match": "MacMatch", "mac_attend": "MacAttend"}
    assert manifest["graphs"]["decode"]["custom_nodes"] == {"MacMatch": N, "MacAttend": N}
    import hashlib
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert {"decode.onnx", "prefill.onnx", "hf/config.json"} <= set(listed)
    for path, digest in listed.items():
        assert hashlib.sha256((out / path).read_bytes()).hexdigest() == digest, path
    for name in ("decode.onnx", "prefill.onnx"):
        check_onnx(out / name)               # full_check + strict shape inference
    from transformers import AutoModelForCausalLM
    reloaded = AutoModelForCausalLM.from_pretrained(out / "hf")
    assert reloaded.config._attn_implementation != "macattn"


def test_decode_graph_contract(llama_engine):
    model = onnx.load(str(llama_engine / "decode.onnx"))
    assert count_custom_nodes(model) == {"MacMatch": N, "MacAttend": N}
    assert {imp.domain: imp.version for imp in model.opset_import}["macattn"] == 1
    ins = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in model.graph.input}
    outs = {vi.name for vi in model.graph.output}
    assert ins["input_ids"] == ["batch", 1] and ins["key.0"][0] == "batch" and ins["key.0"][2] == "context"
    assert ins["qring.1"] == ["num_slots", 4, 16, 32] and ins["ring_pos.1"] == ["num_slots", 16]
    for node in model.graph.node:
        if node.op_type == "MacAttend":
            assert node.domain == "macattn"
            assert {a.name for a in node.attribute} == {"band", "scale"}
            l = node.input[7].split(".")[1]
            assert list(node.input[7:]) == [f"{r}.{l}" for r in RING_NAMES]
            assert list(node.output[1:]) == [f"{r}.{l}.out" for r in RING_NAMES]
            assert set(node.output[1:]) <= outs
        if node.op_type == "MacMatch":
            assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {"band": 4, "tau": 0.0}


def test_polygraphy_inspects_decode_graph(llama_engine):
    exe = shutil.which("polygraphy")
    if exe is None:
        pytest.skip("polygraphy not installed")
    res = subprocess.run([exe, "inspect", "model", str(llama_engine / "decode.onnx")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "'macattn': 1" in res.stdout and "match_pos.1" in res.stdout


def test_llama_onnx_prefill_and_decode_match_torch(llama_engine):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(llama_engine / "hf", attn_implementation="sdpa").eval()
    patch_model(model, MAC_ON)
    _decode_and_compare(model, llama_engine / "decode.onnx", prefill_path=llama_engine / "prefill.onnx")


# --- Qwen2 / Mistral (MAC on) and LLaMA with MAC off ------------------------------------------
@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_onnx_decode_matches_torch(family, tmp_path):
    model = build_builtin_model(family, seed=2, **SMALL)
    patch_model(model, MAC_ON)
    info = export_decode_onnx(model, tmp_path / "decode.onnx")
    assert info.custom_nodes == {"MacMatch": N, "MacAttend": N}
    check_onnx(info.path)
    _decode_and_compare(model, info.path)


def test_calibrated_threshold_graph_matches_torch(tmp_path):
    """``match_scale`` (the calibrated threshold, one scale per head) is in the exported decode graph: the
    query MAC matches and stores is ``q~ / s``, so ONNX Runtime's decisions and rings equal torch's."""
    model = build_builtin_model("llama", seed=5, **SMALL)
    g = torch.Generator().manual_seed(6)
    scales = [(torch.rand(SMALL["num_attention_heads"], generator=g) + 0.5).tolist() for _ in range(N)]
    patch_model(model, MAC_ON.with_match_scales(scales))
    info = export_decode_onnx(model, tmp_path / "decode.onnx")
    assert info.custom_nodes == {"MacMatch": N, "MacAttend": N}
    _decode_and_compare(model, info.path)


def test_mac_off_graph_equals_full_attention(tmp_path):
    model = build_builtin_model("llama", seed=4, **SMALL)
    ids = _ids()
    with torch.no_grad():
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS + 1, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    patch_model(model, MacConfig(enabled=False, window=16, band=4))
    info = export_decode_onnx(model, tmp_path / "decode.onnx")
    assert info.custom_nodes == {"MacAttend": N}        # no match node when MAC is off
    _decode_and_compare(model, info.path, mac_on=False)
    # and the patched model's decode logits (checked equal to ONNX above) equal full attention
    binding_of(model).method.release()
    with torch.no_grad():
        mac_off = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=STEPS + 1,
                                 do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)
    assert torch.equal(full.sequences, mac_off.sequences)
    for a, b in zip(full.logits, mac_off.logits):
        _close(a, b, "MAC off vs full attention", atol=1e-5)


# --- bad input ---------------------------------------------------------------------------------
def test_bad_arguments_are_named():
    model = build_builtin_model("llama", seed=0, **SMALL)
    with pytest.raises(ValueError, match="patched"):
        DecodeStepModule(model)
    patch_model(model, MAC_ON)
    with pytest.raises(ValueError, match="num_slots must be >= batch"):
        example_decode_inputs(model, batch=4, num_slots=2)
    with pytest.raises(ValueError, match="context must be an int >= 2"):
        example_decode_inputs(model, context=1)
    with pytest.raises(ValueError, match="state must hold 6 tensors per layer"):
        DecodeStepModule(model)(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\]"):
        PrefillStepModule(model)(torch.zeros(3, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                                 *[torch.zeros(1)] * (4 * N))
    with pytest.raises(SystemExit):
        main(["build", "--model", "llama", "--tiny", "--from", "x", "--out", "y"])
    from macattn.builder.build import build_engine_dir
    with pytest.raises(TypeError, match="mac must be a MacConfig"):
        build_engine_dir("llama", "/nonexistent", mac={"tau": 0.5}, tiny=True)
    with pytest.raises(ValueError, match="hf_dir must be a transformers model directory"):
        build_engine_dir("llama", "/nonexistent/out", mac=MAC_ON, hf_dir="/nonexistent")
