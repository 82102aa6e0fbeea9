"""``gather_pages``: the missed pages of one layer, host tiers -> device hot-page cache (``kernel.py`` on CUDA
or under Triton's interpreter, ``gather_pages_torch`` on CPU tensors: the same contract)."""
from __future__ import annotations

import torch

__all__ = ["gather_pages", "gather_pages_torch"]


def _check(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor) -> None:
    if src.dim() != 5:
        raise ValueError(f"src must be [S, Hkv, P, page, W], got {tuple(src.shape)}")
    S, H, _, page, W = src.shape
    if dst.dim() != 4 or dst.shape[:2] != (S, H) or dst.shape[2] % page or dst.shape[3] != W:
        raise ValueError(f"dst must be [S={S}, Hkv={H}, C*page (page={page}), W={W}], got {tuple(dst.shape)}")
    if dst.dtype != src.dtype:
        raise TypeError(f"dst must have src's dtype {src.dtype}, got {dst.dtype}")
    if pages.dim() != 3 or pages.shape[:2] != (S, H) or slots.shape != pages.shape or miss.shape != pages.shape:
        raise ValueError(f"pages / slots / miss must be [S={S}, Hkv={H}, K] (one shape), got {tuple(pages.shape)}, "
                         f"{tuple(slots.shape)}, {tuple(miss.shape)}")
    if src.stride(4) != 1 or dst.stride(3) != 1:
        raise ValueError("src and dst need a contiguous last dimension")


def gather_pages_torch(src, dst, pages, slots, miss) -> None:
    """Plain torch (synchronises with the device to find the misses; for CPU tensors)."""
    _check(src, dst, pages, slots, miss)
    S, H, _, page, W = src.shape
    b, h, j = miss.nonzero(as_tuple=True)
    if b.numel() == 0:
        return
    p, c = pages[b, h, j].to(torch.int64), slots[b, h, j].to(torch.int64)
    dst.view(S, H, -1, page, W)[b.to(dst.device), h.to(dst.device), c.to(dst.device)] = \
        src[b.to(src.device), h.to(src.device), p.to(src.device)].to(dst.device, non_blocking=True)


def gather_pages(src: torch.Tensor, dst: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, *,
                 use_kernel: bool | None = None) -> None:
    """Copy ``src[s, h, pages[s, h, j]]`` (``[page, W]``) into ``dst[s, h, slots[s, h, j]·page :
    (slots[s, h, j]+1)·page]`` wherever ``miss[s, h, j]``. ``src [S, Hkv, P, page, W]`` (one layer of the host
    tiers; pinned CPU memory when ``dst`` is on the GPU), ``dst [S, Hkv, C·page, W]`` (the device cache,
    ``src``'s dtype), ``pages`` / ``slots`` int64 and ``miss`` bool ``[S, Hkv, K]`` on ``dst``'s device.
    ``use_kernel`` (None: when ``dst`` is on CUDA): the Triton kernel (no host synchronisation, graph
    capturable), else ``gather_pages_torch``."""
    _check(src, dst, pages, slots, miss)
    if use_kernel is None:
        use_kernel = dst.is_cuda
    if not use_kernel:
        return gather_pages_torch(src, dst, pages, slots, miss)
    import triton

    from .kernel import _gather_pages

    S, H, _, page, W = src.shape
    K = pages.shape[2]
    if S * H * K == 0:
        return
    pages, slots, miss = pages.contiguous(), slots.contiguous(), miss.contiguous().to(torch.int8)
    _gather_pages[(S * H, K)](src, dst, pages, slots, miss, H, K, *src.stride()[:4], *dst.stride()[:3], W,
                              PAGE=page, W_P=triton.next_power_of_2(W), BLOCK_T=min(page, 32), num_warps=4)
