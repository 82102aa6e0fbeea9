"""``macattn::route_fused_attention``: Triton kernels (``kernel.py``) and the CUDA op implementation (``op.py``).

Importing this package needs nothing beyond torch; ``kernel``/``op`` need triton.
"""
