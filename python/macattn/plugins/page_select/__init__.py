"""The offloaded decode's page selector (issue 20): Quest upper bounds of every page per KV head and
the best ``budget`` pages, fused on the GPU (``kernel.py``; launcher ``op.py``). Reference:
``macattn.methods.completion.reference.select_pages_reference``. Importing this package needs only torch."""
