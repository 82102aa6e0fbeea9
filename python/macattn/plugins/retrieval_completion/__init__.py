"""``macattn::retrieval_completion`` and ``macattn::completion_cache``: Triton kernels (``kernel.py``),
the CUDA op implementations (``op.py``) and the TensorRT plugin definitions (``plugin.py``).

Importing this package needs nothing beyond torch; ``kernel``/``op`` need triton.
"""
