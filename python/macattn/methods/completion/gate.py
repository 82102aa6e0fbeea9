"""Per-layer gate of retrieval-completion's linear-attention term (issue 40).

On a given checkpoint the completion term can add more error than it removes (``benchmarks/notes/
completion_fidelity.md``). A ``CompletionGate`` says, per layer, whether the term is used; a layer with it
off runs Top-k alone and spends what the term would have cost on retrieved tokens instead
(``reference.equal_cost_top_k``), so a gated layer never reads more than an ungated one. ``macattn tune --completion``
chooses it on calibration prompts (``macattn.apps.tune.tune_completion_gate``) and writes it with
``save``; ``CompletionConfig(gate=FILE)`` reads it, and through it every surface that takes completion options
(``EngineArgs.completion_gate``, ``LLM(..., completion_gate=FILE)``, ``completion_method``).

Honoured by every decode path through ``reference.layer_top_k`` (the layer's Top-k and whether its term
is on) and ``mask_log_phi_q`` (the resident and page ops: ``log φ_q = -inf`` gives the term zero weight, so the
op computes exactly Top-k alone over its exact set); the offloaded decode skips the term and its ``log φ_k``
page fetches natively.

File (JSON): ``{"kind": "completion_gate", "layers": [bool, ...], "gen_len": int, "tuned_for": {...}}``;
``tuned_for`` records the settings it was chosen under (budget, sink / tail, maps; informational).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from macattn.core.validation import check_int

if TYPE_CHECKING:            # the gate file is read without torch (CompletionConfig, EngineArgs' checks)
    import torch

__all__ = ["CompletionGate", "mask_log_phi_q", "GATE_KIND"]

GATE_KIND = "completion_gate"


def mask_log_phi_q(log_phi_q: torch.Tensor, on: bool) -> torch.Tensor:
    """``log φ_q [..., F]`` unchanged when the layer's term is ``on``, else all ``-inf`` (φ_q = 0: the term's
    numerator and its share of the denominator are exactly 0, the step is Top-k alone)."""
    return log_phi_q if on else log_phi_q.new_full(log_phi_q.shape, -math.inf)


@dataclass(frozen=True)
class CompletionGate:
    """layers: per layer, True = the completion term is used (one entry per layer, all False allowed: the term
    off everywhere); gen_len: decode steps the cache is amortised over in ``reference.equal_cost_top_k`` (>= 1);
    tuned_for: the settings it was chosen under."""

    layers: tuple[bool, ...]
    gen_len: int
    tuned_for: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (tuple, list)) or not self.layers or \
                not all(isinstance(x, bool) for x in self.layers):
            raise ValueError(f"layers must be a non-empty sequence of bools, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        check_int("gen_len", self.gen_len, 1)
        if not isinstance(self.tuned_for, dict):
            raise TypeError(f"tuned_for must be a dict, got {type(self.tuned_for).__name__}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_layers(self, num_layers: int) -> None:
        """``ValueError`` unless the gate has one entry per layer of a ``num_layers``-layer model."""
        if self.num_layers != num_layers:
            raise ValueError(f"the completion gate has {self.num_layers} layers, the model {num_layers}")

    def to_dict(self) -> dict:
        return {"kind": GATE_KIND, "layers": list(self.layers), "gen_len": self.gen_len, "tuned_for": self.tuned_for}

    @classmethod
    def from_dict(cls, d: dict) -> "CompletionGate":
        if not isinstance(d, dict) or d.get("kind") != GATE_KIND:
            raise ValueError(f"not a completion gate (kind must be {GATE_KIND!r}), got "
                             f"{d.get('kind') if isinstance(d, dict) else type(d).__name__!r}")
        unknown, missing = set(d) - {"kind", "layers", "gen_len", "tuned_for"}, {"layers", "gen_len"} - set(d)
        if unknown or missing:
            raise ValueError(f"completion gate fields: unknown {sorted(unknown)}, missing {sorted(missing)}")
        return cls(layers=tuple(d["layers"]), gen_len=d["gen_len"], tuned_for=d.get("tuned_for", {}))

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> "CompletionGate":
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"completion gate {p} not found; write one with `macattn tune --completion`")
        return cls.from_dict(json.loads(p.read_text()))
