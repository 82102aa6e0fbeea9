"""macattn: fast long-context decode attention with fidelity.

One package in layers that import only downwards (``docs/architecture.md``): ``core``
(validation, the match rule, attention summaries) < ``plugins`` (Triton kernels, launchers,
TensorRT plugin definitions) < ``methods`` (the ``AttentionMethod`` interface, the registry and
one folder per method) < ``models`` (the transformers integration) < ``runtime`` | ``builder``
(engine and serving | graph export and engine builds) < ``evaluation`` < ``apps`` < ``cli``.
"""

from macattn.core.summaries import AttentionSummary, merge_summaries, remove_summary, summarize
from macattn.methods.mac.config import LayerMacParams, MacConfig

__version__ = "0.1.0"
__all__ = ["AttentionSummary", "LayerMacParams", "MacConfig", "merge_summaries", "remove_summary",
           "summarize", "LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    """``LLM`` / ``SamplingParams`` (the LLM API, ``macattn.apps.llm``), imported on first use."""
    if name in ("LLM", "SamplingParams"):
        from macattn.apps import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'macattn' has no attribute {name!r}")
