"""``index_store_``: indexed writes into float8 (through raw bytes) and ordinary dtypes, poisoned destinations."""
import pytest
import torch

from macattn.core.indexing import index_store_


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_index_store_equals_an_indexed_assignment(dtype):
    g = torch.Generator().manual_seed(0)
    dst = torch.full((5, 3, 7, 4), -3.0).to(dtype)                     # poison
    ref = dst.float().clone()
    slots, cols = torch.tensor([4, 0, 2]), torch.tensor([6, 0, 3])
    value = torch.randn(3, 3, 4, generator=g) * 10
    index_store_(dst, (slots, slice(None), cols), value)
    ref[slots, :, cols] = value.to(dtype).float()
    assert torch.equal(dst.float(), ref)
    index_store_(dst, torch.tensor([1]), torch.zeros(1, 3, 7, 4))
    assert torch.count_nonzero(dst[1].float()) == 0 and torch.equal(dst[3].float(), ref[3])
