"""A test-only stand-in for the few ``tensorrt_llm`` modules ``macattn.builder.trtllm_pytorch.backend`` subclasses,
written as files (``write_fake_trtllm``) so that a spawned worker process imports it too.

It is not TensorRT-LLM and computes nothing of it. It keeps what the MAC classes touch, in the order upstream
calls it, as read in NVIDIA/TensorRT-LLM (the commits are the ones ``docs/tensorrt.md`` pins):

* ``TrtllmAttention.forward(q, k, v, metadata, ..., **kwargs)`` (``_torch/attention_backend/trtllm.py`` at
  9144c0e6a535f6f3108d870bc1eef158853cb2ea): checks the metadata type; when ``self.sparse_attention_config`` is
  not None calls ``self.sparse_kv_predict(q, k, metadata, **kwargs)`` then
  ``self.sparse_attn_predict(q, k, metadata, **kwargs)`` (both raise ``NotImplementedError`` in the base
  class), then plans and runs the attention op (here: records the calls and returns zeros ``[tokens, Hq*d]``).
* ``AttentionMetadata.create_cuda_graph_metadata(max_batch_size, sub_cross_metadata=False,
  max_draft_tokens=0, buffers=None)`` returns a shallow copy with ``is_cuda_graph = True``
  (``_torch/attention_backend/interface.py``); the CUDA-graph runner calls it before capturing.
* ``KVCacheManager.__init__(kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim,
  tokens_per_block, max_seq_len, max_batch_size, mapping, ..., max_beam_width=1, **kwargs)`` and the static
  ``get_cache_size_per_token(model_config, mapping, **kwargs)`` (K and V, 2 bytes, per layer, ``Hkv / tp``
  heads) the KV-cache estimator calls (``_torch/pyexecutor/resource_manager.py``; RocketKV overrides it).
* ``sparse/registry.py``: a fixed ``if / elif`` on ``sparse_attn_config.algorithm`` (``rocket`` only here).
* ``llmapi/llm_args.BaseSparseAttentionConfig``: a pydantic model with ``algorithm``.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

_FILES = {
    "__init__.py": '__version__ = "{version}"\n',
    "_torch/__init__.py": "",
    "_torch/attention_backend/__init__.py": "",
    "_torch/attention_backend/interface.py": '''
        import copy


        class AttentionMetadata:
            def __init__(self, **fields):
                self.is_cuda_graph = False
                self.max_num_requests = 0
                self.__dict__.update(fields)

            def prepare(self):
                pass

            def create_cuda_graph_metadata(self, max_batch_size, sub_cross_metadata=False, max_draft_tokens=0,
                                           buffers=None):
                if self.is_cuda_graph:
                    return self
                md = copy.copy(self)
                md.is_cuda_graph = True
                md.max_num_requests = max_batch_size
                return md


        class AttentionBackend:
            Metadata = AttentionMetadata

            def __init__(self, layer_idx, num_heads, head_dim, num_kv_heads=None, quant_config=None,
                         sparse_attention_config=None, pos_embd_params=None, **kwargs):
                self.layer_idx, self.num_heads, self.head_dim = layer_idx, num_heads, head_dim
                self.num_kv_heads = num_kv_heads or num_heads
                self.quant_config, self.sparse_attention_config = quant_config, sparse_attention_config
                self.pos_embd_params = pos_embd_params
    ''',
    "_torch/attention_backend/trtllm.py": '''
        import torch

        from .interface import AttentionBackend, AttentionMetadata


        class TrtllmAttentionMetadata(AttentionMetadata):
            pass


        class TrtllmAttention(AttentionBackend):
            Metadata = TrtllmAttentionMetadata
            calls = []

            def forward(self, q, k, v, metadata, *args, **kwargs):
                assert isinstance(metadata, TrtllmAttentionMetadata)
                sparse = (None, None, None, None)
                if self.sparse_attention_config is not None:
                    sparse = (*self.sparse_kv_predict(q, k, metadata, **kwargs),
                              *self.sparse_attn_predict(q, k, metadata, **kwargs))
                TrtllmAttention.calls.append(("plan", sparse))
                TrtllmAttention.calls.append(("run", q.shape[0]))
                return torch.zeros(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype)

            def sparse_attn_predict(self, q, k, metadata, **kwargs):
                raise NotImplementedError

            def sparse_kv_predict(self, q, k, metadata, **kwargs):
                raise NotImplementedError
    ''',
    "_torch/attention_backend/sparse/__init__.py": "",
    "_torch/attention_backend/sparse/registry.py": '''
        def get_sparse_attn_kv_cache_manager(sparse_attn_config):
            if sparse_attn_config.algorithm == "rocket":
                return "RocketKVCacheManager"
            raise ValueError(f"Unsupported sparse attention algorithm: {sparse_attn_config.algorithm}")


        def get_trtllm_sparse_attn_attention_backend(sparse_attn_config):
            if sparse_attn_config.algorithm == "rocket":
                return "RocketTrtllmAttention"
            raise ValueError(f"Unsupported sparse attention algorithm: {sparse_attn_config.algorithm}")
    ''',
    "_torch/pyexecutor/__init__.py": "",
    "_torch/pyexecutor/resource_manager.py": '''
        class KVCacheManager:
            def __init__(self, kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads, head_dim,
                         tokens_per_block, max_seq_len, max_batch_size, mapping, max_beam_width=1, **kwargs):
                self.kv_cache_config, self.num_layers, self.max_seq_len = kv_cache_config, num_layers, max_seq_len
                self.tokens_per_block, self.max_batch_size = tokens_per_block, max_batch_size

            @staticmethod
            def get_cache_size_per_token(model_config, mapping, **kwargs):
                pc = model_config.pretrained_config
                head_dim = pc.hidden_size // pc.num_attention_heads
                kv_heads = pc.num_key_value_heads // mapping.tp_size
                return 2 * 2 * kv_heads * head_dim * pc.num_hidden_layers

            def prepare_resources(self, scheduled_batch):
                pass

            def free_resources(self, request):
                pass
    ''',
    "llmapi/__init__.py": "",
    "llmapi/llm_args.py": '''
        from pydantic import BaseModel


        class BaseSparseAttentionConfig(BaseModel):
            algorithm: str = "base"

            def supports_backend(self, backend):
                return True
    ''',
}


def write_fake_trtllm(root: Path, version: str = "1.2.0") -> Path:
    """Write the stand-in package ``tensorrt_llm`` (version ``version``) under ``root``; returns ``root``."""
    for rel, text in _FILES.items():
        path = root / "tensorrt_llm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text.format(version=version) if rel == "__init__.py" else text).lstrip())
    return root


def unload_fake_trtllm() -> None:
    """Drop every ``tensorrt_llm`` module from ``sys.modules``."""
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]
