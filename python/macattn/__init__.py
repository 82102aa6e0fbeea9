"""macattn: fast long-context decode attention with fidelity.

Reference math lives in this package root (``summaries``, ``mac``, ``config``); GPU
kernels and TensorRT plugin definitions in ``macattn.plugins``; model patching, graph
export and engine building in ``macattn.builder``; state, generation and serving in
``macattn.runtime``.
"""
from macattn.methods.mac.config import LayerMacParams, MacConfig
from macattn.core.summaries import AttentionSummary, merge_summaries, remove_summary, summarize

__version__ = "0.1.0"
__all__ = ["AttentionSummary", "LayerMacParams", "MacConfig", "merge_summaries", "remove_summary",
           "summarize", "__version__"]
