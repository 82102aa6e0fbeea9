"""A plain-torch ``DecodePlans`` for CPU tests of the GPU decode path (``CudaDecoder`` run eagerly): full
attention over each row's pages ``[0, m]`` through the bucket's page table."""
import math

import torch

from macattn.core.attention import full_attention_reference
from macattn.methods.base import DecodePlans

__all__ = ["PagedReference", "attach_cpu_decoder"]


class PagedReference(DecodePlans):
    """Full attention over each row's pages ``[0, m]`` through the bucket's page table, in plain torch."""

    def attend_full(self, q, k_pages, v_pages, positions):
        ps, out = self.geometry.page_size, []
        for b in range(q.shape[0]):
            n = int(positions[b]) + 1
            blocks = self.page_table[b, : -(-n // ps)].long()
            k, v = (t[blocks].flatten(0, 1)[:n].transpose(0, 1).unsqueeze(0) for t in (k_pages, v_pages))
            out.append(full_attention_reference(q[b:b + 1], k, v, positions[b:b + 1],
                                                scale=1.0 / math.sqrt(q.shape[-1])).to(q.dtype))
        return torch.cat(out)


def attach_cpu_decoder(engine) -> None:
    """Run ``engine``'s decode through ``CudaDecoder`` eagerly on the CPU, with the bookkeeping the GPU path
    has: a scratch state slot and a scratch KV block of its own for the padding rows."""
    from macattn.runtime.cuda_decode import CudaDecoder

    ex = engine.executor
    ex.reserve_scratch(engine.slot_states.acquire())
    ex.scratch_block = ex.blocks.num_blocks - 1
    ex.blocks.free_blocks.remove(ex.scratch_block)
    ex.decoder = CudaDecoder(ex, use_cuda_graphs=False)
