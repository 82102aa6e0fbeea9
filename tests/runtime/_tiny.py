"""Shared tiny model and prompts for the runtime tests (2 layers, hidden 64, vocab 256, fp64)."""
import torch

from macattn.methods.mac.config import MacConfig
from macattn.models.builtin import build_builtin_model

TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256)
# small window / band, low tau: hits happen on the repetitive prompts below
MAC = MacConfig(window=16, band=4, tau=0.2)


def tiny_model(family: str = "llama", seed: int = 1):
    """fp64 so batched and solo runs agree far below any greedy or threshold margin."""
    return build_builtin_model(family, seed=seed, **TINY).to(torch.float64)


def prompts(n: int, *, seed: int = 0, lo: int = 20, hi: int = 60) -> list[torch.Tensor]:
    """``n`` int64 prompts of ``lo .. hi`` tokens: a random 6..12-token motif repeated, 10 % mutated."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        period = int(torch.randint(6, 13, (1,), generator=g))
        ids = torch.randint(0, 256, (period,), generator=g).repeat(-(-length // period))[:length].clone()
        flip = torch.rand(length, generator=g) < 0.1
        ids[flip] = torch.randint(0, 256, (int(flip.sum()),), generator=g)
        out.append(ids)
    return out
