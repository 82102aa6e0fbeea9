"""Drive an ``LLMEngine`` running the retrieval-completion method one request / one step at a time
(the engine's own scheduler and executor), so tests can compare logits step by step."""
from __future__ import annotations

import torch

from macattn.apps.distill_completion import maps_for_model
from macattn.methods.completion.config import CompletionConfig
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine


def completion_maps(model, cfg: CompletionConfig):
    maps = maps_for_model(model, feature_dim=cfg.feature_dim, hidden=cfg.hidden, seed=3)
    with torch.no_grad():   # non-trivial maps (α != 0) so the completion term really differs from selection
        for m in list(maps.phi_q) + list(maps.phi_k):
            m.alpha.fill_(0.5)
    return maps


class CompletionEngine:
    """``LLMEngine(model, method="completion")`` with ``slots`` requests in flight, 128 tokens each."""

    def __init__(self, model, cfg: CompletionConfig, *, slots: int = 2, use_op: bool | None = False,
                 device: str = "cpu", maps=None, graphs: bool = False) -> None:
        maps = completion_maps(model, cfg) if maps is None else maps
        self.engine = LLMEngine(model, None, RuntimeConfig(max_batch_size=slots, max_seq_len=128, device=device,
                                                           use_cuda_graphs=graphs),
                                method="completion", method_config=cfg,
                                method_kwargs={"maps": maps, "use_op": use_op})
        self.method = self.engine.method
        self.state = self.method.state
        self.maps = self.method.maps
        self.model = self.engine.model

    def generate(self, prompts, *, max_new_tokens: int) -> list[list[int]]:
        ids = [self.engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
        self.engine.run_to_completion()
        return [self.engine.pop_finished(i).output for i in ids]

    def admit(self, prompt, max_new_tokens: int = 16):
        """Admit and prefill one request: ``(seq, logits [V])``."""
        seq = self.engine.make_request(prompt, max_new_tokens=max_new_tokens)
        self.engine.submit(seq)
        admitted = self.engine.scheduler.admit()
        assert admitted == [seq]
        return seq, self.engine.executor.prefill(seq)

    def decode(self, seqs, tokens) -> torch.Tensor:
        """Feed ``tokens[i]`` to ``seqs[i]`` at its next position: logits ``[B, V]``."""
        for s, t in zip(seqs, tokens):
            s.output.append(int(t))
        return self.engine.executor.decode(list(seqs))

    def release(self, seq) -> None:
        self.engine.scheduler.finish(seq, "aborted")
