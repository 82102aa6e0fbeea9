"""The transformers releases macattn supports, and the calls whose spelling changed between them.

``SUPPORTED_TRANSFORMERS`` is the range ``pyproject.toml`` pins (a test keeps the two equal);
``check_transformers_version`` raises, naming the installed version and the range, outside it. The patched
attention follows transformers' internals (the attention and mask interfaces, the cache's ``update``), so a
release past the bound is refused rather than run: 5.40 removes the ``past_key_values`` spelling that the
releases before the rename take.

The KV cache a forward takes and returns is named ``cache`` from the rename on (5.2x) and
``past_key_values`` before it, in every model and decoder layer alike: ``CACHE_KWARG`` is the installed
release's name (a constant, so traced and exported code reads it too) and ``returned_cache(output)`` the
cache a forward returned, so one call reads the same on every supported release and warns on none.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager

__all__ = ["SUPPORTED_TRANSFORMERS", "CACHE_KWARG", "check_transformers_version", "returned_cache",
           "no_transformers_progress"]

SUPPORTED_TRANSFORMERS = ">=4.56,<5.40"   # 4.56: from_pretrained takes dtype=


def check_transformers_version(version: str | None = None) -> str:
    """The installed transformers version (or ``version``) when ``SUPPORTED_TRANSFORMERS`` holds it; raises
    ``RuntimeError`` naming the version and the range otherwise."""
    from packaging.specifiers import SpecifierSet

    if version is None:
        import transformers

        version = transformers.__version__
    if version not in SpecifierSet(SUPPORTED_TRANSFORMERS, prereleases=True):
        raise RuntimeError(f"transformers {version} is not supported: macattn needs transformers"
                           f"{SUPPORTED_TRANSFORMERS} (pip install 'transformers{SUPPORTED_TRANSFORMERS}')")
    return version


def returned_cache(output):
    """The KV cache a forward returned: the ``CACHE_KWARG`` field of its ``ModelOutput``."""
    return getattr(output, CACHE_KWARG)


@contextmanager
def no_transformers_progress():
    """transformers' own progress bars (``Loading weights``) off inside the block, as they were after it: the
    caller shows its own."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


check_transformers_version()
CACHE_KWARG = _cache_kwarg()
"""The keyword of the KV cache in a model's or decoder layer's ``forward`` (and its output's field)."""
