"""FastMKA (docs/spec.md §2) as an ``AttentionMethod`` that composes with the engine's attention method:
the route-fused memory (``macattn.models.mka.patch_mka``, trained router weights) replaces the
K/V projections' input, and the attention itself is the other method's. What it owns in the
engine is the per-request session summary ``L2_t`` (``MkaState``), registered with the slot
registry like any method state."""
from __future__ import annotations

from typing import ClassVar

from macattn.methods.base import AttentionMethod, Capabilities, ModelDims
from macattn.methods.mka.config import MkaConfig
from macattn.methods.mka.state import MkaState

__all__ = ["FastMka"]


class FastMka(AttentionMethod):
    name: ClassVar[str] = "mka"
    config_type: ClassVar[type] = MkaConfig
    capabilities: ClassVar[Capabilities] = Capabilities(paged_kv=True, cuda_graphs=True, onnx_export=True,
                                                        tensorrt_plugin=True, needs_pre_rope_query=True,
                                                        composes=True)

    def __init__(self, config: MkaConfig, dims: ModelDims, *, num_slots: int) -> None:
        super().__init__(config, dims, num_slots=num_slots)
        self.state = MkaState.allocate(num_layers=dims.num_layers, num_slots=num_slots,
                                       hidden_size=dims.hidden_size, device=dims.device)

    def slot_states(self):
        return {"fastmka": self.state}
