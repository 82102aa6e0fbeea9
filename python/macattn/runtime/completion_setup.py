"""Retrieval-completion's serving options in one place (``EngineArgs.build_engine``, so ``LLM``, ``macattn
serve``, the Triton model and ``ModelRunner``): from ``(method, completion, maps, kv_offload, offload,
prefix_store)`` to the engine's ``(method name, method_config, method_kwargs)``. ``kv_offload="host"`` selects the engine method ``completion_offload`` (prompt KV in host memory,
selected pages fetched per step); ``prefix_store`` is a directory of persisted prompts (``chunk_store.
prefix_store``, keyed by the model's fingerprint)."""
from __future__ import annotations

from dataclasses import replace

from macattn.methods.completion.config import CompletionConfig
from macattn.methods.completion.feature_maps import CompletionFeatureMaps, load_feature_maps, maps_for_model
from macattn.methods.completion.offload import OffloadConfig
from macattn.runtime.chunk_store import model_fingerprint
from macattn.runtime.chunk_store import prefix_store as make_prefix_store

__all__ = ["KV_OFFLOAD", "completion_method"]

KV_OFFLOAD = (None, "host")
_KEYS = ("completion", "maps", "gate", "kv_offload", "offload", "prefix_store")


def completion_method(model, method: str, *, completion=None, maps=None, gate=None, kv_offload=None, offload=None,
                      prefix_store=None, prefix_store_max_bytes: int | None = None
                      ) -> tuple[str, CompletionConfig | None, dict | None]:
    """The engine's ``(method name, method_config, method_kwargs)``. ``completion``: a ``CompletionConfig``
    (default: exhaustive, or ``"quest"`` with ``kv_offload``); ``maps``: a ``CompletionFeatureMaps``, a
    ``save_feature_maps`` directory, or None (untrained init); ``gate``: the completion term's per-layer gate, a
    ``CompletionGate`` or its JSON file (``macattn tune --completion``; read by ``CompletionConfig``), or None;
    ``kv_offload``: None or ``"host"``; ``offload``: an ``OffloadConfig``; ``prefix_store``: a directory. Other
    methods take none of these (``ValueError``)."""
    if kv_offload not in KV_OFFLOAD:
        raise ValueError(f"kv_offload must be one of {KV_OFFLOAD}, got {kv_offload!r}")
    if method != "completion":
        given = [n for n, v in zip(_KEYS, (completion, maps, gate, kv_offload, offload, prefix_store))
                 if v is not None]
        if given:
            raise ValueError(f"{given[0]} is retrieval-completion's option; method={method!r} takes none")
        return method, None, None
    cfg = completion if completion is not None else CompletionConfig(selector="quest" if kv_offload else "exact")
    if not isinstance(cfg, CompletionConfig):
        raise TypeError(f"completion must be a CompletionConfig, got {type(cfg).__name__}")
    if gate is not None:
        if cfg.gate is not None:
            raise ValueError("gate is given twice: as the gate argument and as completion.gate; give one")
        cfg = replace(cfg, gate=gate)
    if maps is None:
        maps = maps_for_model(model, feature_dim=cfg.feature_dim, hidden=cfg.hidden)
    elif not isinstance(maps, CompletionFeatureMaps):
        maps = load_feature_maps(maps)
    if kv_offload is None:
        if offload is not None or prefix_store is not None:
            raise ValueError("offload and prefix_store need kv_offload='host'")
        return "completion", cfg, {"maps": maps}
    if offload is not None and not isinstance(offload, OffloadConfig):
        raise TypeError(f"offload must be an OffloadConfig, got {type(offload).__name__}")
    store = None if prefix_store is None else make_prefix_store(prefix_store, model_id=model_fingerprint(model),
                                                                max_bytes=prefix_store_max_bytes)
    return "completion_offload", cfg, {"maps": maps, "offload": offload, "store": store}
