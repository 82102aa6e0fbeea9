"""macattn: fast long-context decode attention with fidelity.

One package in layers that import only downwards (``docs/architecture.md``): ``core``
(validation, the match rule, attention summaries) < ``plugins`` (Triton kernels, launchers,
TensorRT plugin definitions) < ``methods`` (the ``AttentionMethod`` interface, the registry and
one folder per method) < ``models`` (the transformers integration) < ``runtime`` | ``builder``
(engine and serving | graph export and engine builds) < ``evaluation`` < ``apps`` < ``cli``.
"""

import importlib

__version__ = "0.1.0"
# the public names and their modules, imported on first use: ``import macattn`` (and ``macattn --help``)
# loads neither torch nor transformers
_EXPORTS = {"AttentionSummary": "core.summaries", "merge_summaries": "core.summaries",
            "remove_summary": "core.summaries", "summarize": "core.summaries",
            "LayerMacParams": "methods.mac.config", "MacConfig": "methods.mac.config",
            "LLM": "apps.llm", "SamplingParams": "apps.llm"}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    """The public names of ``_EXPORTS`` (the LLM API ``LLM`` / ``SamplingParams`` among them), from their
    module on first use."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"macattn.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'macattn' has no attribute {name!r}")
