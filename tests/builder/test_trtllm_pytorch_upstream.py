"""Issue 36 items 2-6 and the version range: the classes ``backend.load()`` defines, over a test-only stand-in of
the upstream modules they subclass (``trtllm_fake``: upstream's call order at the commits docs/tensorrt.md pins).

TensorRT-LLM is not installed here and none of it runs: these tests check what our subclasses do when upstream's
code calls them the way it does — the sparse hooks of ``TrtllmAttention.forward``, the CUDA-graph runner's
``create_cuda_graph_metadata``, the KV-cache estimator's ``get_cache_size_per_token``, the manager's
``kv_cache_config``, and unpickling the config in a fresh process (the LLM API's spawned worker).
"""
from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from macattn.builder.trtllm_pytorch import backend
from macattn.builder.trtllm_pytorch.ring_slots import ring_bytes_per_request, ring_bytes_per_token
from macattn.methods.mac.config import MacConfig
from macattn.methods.mac.state import MacState
from macattn.plugins.trt_compat import TensorRTVersionError
from trtllm_fake import unload_fake_trtllm, write_fake_trtllm

PACKAGE = Path(backend.__file__).resolve().parents[3]       # .../python


@pytest.fixture()
def upstream(tmp_path, monkeypatch):
    """``(classes, tmp_path)`` with the stand-in ``tensorrt_llm`` 1.2.0 importable and ``backend.load()`` done."""
    write_fake_trtllm(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backend, "_LOADED", None)
    try:
        yield backend.load(), tmp_path
    finally:
        unload_fake_trtllm()


def _config(classes, **kw):
    return classes.config(**{"window": 16, "band": 4, "tau": 0.5, **kw})


def _rope():
    rope = SimpleNamespace(dim=16, theta=10000.0, scale_type="none", scale=1.0, max_positions=64)
    return SimpleNamespace(rope=rope, is_neox=True)


def test_item2_trtllm_forward_calls_the_sparse_hooks(upstream):
    """Upstream's forward calls ``sparse_kv_predict`` / ``sparse_attn_predict`` whenever a sparse config is set;
    the base versions raise ``NotImplementedError``."""
    classes, _ = upstream
    from tensorrt_llm._torch.attention_backend.trtllm import TrtllmAttention

    TrtllmAttention.calls.clear()
    attn = classes.attention(0, 4, 16, num_kv_heads=2, sparse_attention_config=_config(classes),
                             pos_embd_params=_rope())
    metadata = classes.metadata(mac_step=None, mac_spans=None)
    out = attn.forward(torch.randn(3, 4 * 16 + 2 * 2 * 16), None, None, metadata)
    assert out.shape == (3, 64)
    assert TrtllmAttention.calls == [("plan", (None, None, None, None)), ("run", 3)]


def test_item3_cuda_graph_capture_is_refused(upstream):
    classes, _ = upstream
    md = classes.metadata()
    with pytest.raises(ValueError, match=r"CUDA graph.*cuda_graph_config=None"):
        md.create_cuda_graph_metadata(8)
    with pytest.raises(ValueError, match=r"cuda_graph_config=None"):
        classes.metadata(is_cuda_graph=True).prepare()


def test_item4_config_unpickles_in_a_fresh_worker_and_installs_the_dispatch(upstream):
    """The LLM API pickles its arguments into a spawned executor worker, where ``install()`` never ran."""
    classes, root = upstream
    cfg = _config(classes, window=64, layer_overrides={1: {"window": 32}})
    assert type(cfg).__module__ == backend.REGISTERED_MODULE
    child = ("import pickle, sys\n"
             "cfg = pickle.loads(sys.stdin.buffer.read())\n"
             "from tensorrt_llm._torch.attention_backend.sparse import registry as r\n"
             "print(type(cfg).__name__, r.get_sparse_attn_kv_cache_manager(cfg).__name__,\n"
             "      r.get_trtllm_sparse_attn_attention_backend(cfg).__name__, cfg.mac_config().for_layer(1).window)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(PACKAGE)])}
    run = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(cfg), capture_output=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    assert run.stdout.decode().split() == ["MacSparseAttentionConfig", "MacKVCacheManager", "MacTrtllmAttention",
                                           "32"]


def test_item5_rings_are_declared_to_the_kv_cache_estimator(upstream):
    classes, _ = upstream
    cfg = _config(classes, window=128, layer_overrides={2: {"window": 64}})
    pc = SimpleNamespace(num_attention_heads=8, num_key_value_heads=2, hidden_size=512, num_hidden_layers=3,
                         max_position_embeddings=4096)
    model_config = SimpleNamespace(pretrained_config=pc, sparse_attention_config=cfg, torch_dtype=torch.bfloat16)
    mapping = SimpleNamespace(tp_size=2, enable_attention_dp=False)
    from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager

    base = KVCacheManager.get_cache_size_per_token(model_config, mapping, max_seq_len=1024)
    got = classes.kv_cache_manager.get_cache_size_per_token(model_config, mapping, max_seq_len=1024)
    rings = ring_bytes_per_token(cfg.mac_config(), num_layers=3, num_q_heads=4, head_dim=64,
                                 query_dtype=torch.bfloat16, max_seq_len=1024)
    assert got == base + rings and rings > 0
    # without max_seq_len from the estimator: the model's max_position_embeddings
    assert classes.kv_cache_manager.get_cache_size_per_token(model_config, mapping) == base + ring_bytes_per_token(
        cfg.mac_config(), num_layers=3, num_q_heads=4, head_dim=64, query_dtype=torch.bfloat16, max_seq_len=4096)


def test_item5_ring_bytes_are_what_mac_state_allocates():
    cfg = MacConfig(window=16, band=4, tau=0.5, layer_overrides={1: {"window": 8}, 2: {"enabled": False}})
    state = MacState.allocate(cfg, num_layers=3, num_slots=5, num_q_heads=4, head_dim=16, query_dtype=torch.float16)
    real = sum(t.numel() * t.element_size() for ts in (state.qring, state.oring, state.ring_lse, state.ring_pos)
               for t in ts)
    per = ring_bytes_per_request(cfg, num_layers=3, num_q_heads=4, head_dim=16, query_dtype=torch.float16)
    assert 5 * per == real
    assert ring_bytes_per_token(cfg, num_layers=3, num_q_heads=4, head_dim=16, query_dtype=torch.float16,
                                max_seq_len=7) == -(-per // 7)
    with pytest.raises(ValueError, match="max_seq_len"):
        ring_bytes_per_token(cfg, num_layers=3, num_q_heads=4, head_dim=16, query_dtype=torch.float16, max_seq_len=0)


def test_item6_kv_block_reuse_is_refused(upstream):
    classes, _ = upstream
    kw = dict(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, max_seq_len=64, max_batch_size=3,
              mapping=None, sparse_attn_config=_config(classes))
    with pytest.raises(ValueError, match=r"enable_block_reuse=False"):
        classes.kv_cache_manager(SimpleNamespace(enable_block_reuse=True), "SELF", **kw)
    mgr = classes.kv_cache_manager(SimpleNamespace(enable_block_reuse=False), "SELF", **kw)
    assert mgr.ring_pool.num_slots == 3


@pytest.mark.parametrize("version", ["1.1.0", "1.3.0rc2", "2.0.0"])
def test_item10_version_range_is_gated_both_ways(tmp_path, monkeypatch, version):
    write_fake_trtllm(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backend, "_LOADED", None)
    try:
        with pytest.raises(TensorRTVersionError, match=rf"tensorrt_llm >= 1\.2, < 1\.3.*found tensorrt_llm {version}"):
            backend.load()
    finally:
        unload_fake_trtllm()
