"""Per-layer gate of retrieval-completion's linear-attention term (issue 40).

On a given checkpoint the completion term can add more error than it removes (``benchmarks/notes/
completion_fidelity.md``). A ``CompletionGate`` says, per layer, whether the term is used; a layer with it
off runs Top-k alone and spends what the term would have cost on retrieved tokens instead: the budget's own Top-k
alone at the Top-k the gate was tuned at (``off_top_k``), else ``reference.equal_cost_top_k``, so a gated layer never
reads more than the budget (with every layer off, a tuned gate is exactly Top-k alone at that budget).
``macattn tune --completion`` chooses it on calibration prompts (``macattn.apps.tune.tune_completion_gate``) and
writes it with ``save``; ``CompletionConfig(gate=FILE)`` reads it, and through it every surface that takes
completion options (``EngineArgs.completion_gate``, ``LLM(..., completion_gate=FILE)``, ``completion_method``).

A layer whose term is on may also carry a calibrated mass (``log_mass``, per query head): the distilled maps
estimate the unselected middle's softmax mass on the whole mid region, while the step needs what the Top-k leaves
of it, and over-estimate it (by e^1.3 to e^2.3 on the built-in checkpoint, ``benchmarks/notes/completion_fidelity.md``).
``log_mass[l][h] = δ`` multiplies the term's numerator and denominator by ``e^δ`` (its share of the softmax) and
leaves its direction ``num / den`` as it is; ``macattn tune --completion`` fits it at the target budget
(``macattn.methods.completion.mass``).

Honoured by every decode path through ``reference.layer_top_k`` (the layer's Top-k and whether its term
is on) and ``gated_log_phi_q`` (``log φ_q + δ``, or ``-inf`` for a layer whose term is off: the term's weight is
exactly 0, so the op computes exactly Top-k alone over its exact set); the resident op, the page op and the
offloaded decode all take ``log φ_q`` through it, and the offloaded decode also skips a gated-off layer's
``log φ_k`` page fetches.

File (JSON): ``{"kind": "completion_gate", "layers": [bool, ...], "gen_len": int, "log_mass": [[float, ...],
...] (optional), "off_top_k": [k, k_off] (optional), "tuned_for": {...}}``; ``tuned_for`` records the settings
it was chosen under (budget, sink / tail, maps; informational).
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

__all__ = ["CompletionGate", "gated_log_phi_q", "GATE_KIND"]

GATE_KIND = "completion_gate"


def gated_log_phi_q(log_phi_q: torch.Tensor, on: bool, log_mass: torch.Tensor | None = None) -> torch.Tensor:
    """``log φ_q [..., Hq, F]`` of a layer whose term is ``on``, plus its calibrated mass ``log_mass [Hq]``
    (``CompletionGate.log_mass_tensors``; None: unchanged) on every feature of a head; all ``-inf`` when off
    (φ_q = 0: the term's numerator and its share of the denominator are exactly 0, the step is Top-k alone)."""
    if not on:
        return log_phi_q.new_full(log_phi_q.shape, -math.inf)
    if log_mass is None:
        return log_phi_q
    if log_mass.shape != log_phi_q.shape[-2:-1]:
        raise ValueError(f"log_mass must be [Hq={log_phi_q.shape[-2]}], got {list(log_mass.shape)}")
    return log_phi_q + log_mass.to(device=log_phi_q.device, dtype=log_phi_q.dtype)[:, None]


@dataclass(frozen=True)
class CompletionGate:
    """layers: per layer, True = the completion term is used (one entry per layer, all False allowed: the term
    off everywhere); gen_len: decode steps the cache is amortised over in ``reference.equal_cost_top_k`` (>= 1);
    log_mass: None (no correction) or per layer one finite ``δ`` per query head added to ``log φ_q`` where the
    term is on (the term's mass times ``e^δ``; read, never used, where it is off); off_top_k: None or ``(k,
    k_off)``: for a request at the Top-k ``k`` the gate was tuned at, a layer with the term off runs Top-k alone at
    ``k_off``, the Top-k alone of that budget (``reference.layer_top_k``; the cost model's ``equal_cost_top_k``
    rounds down and can be a token or two short of it); tuned_for: the settings it was chosen under."""

    layers: tuple[bool, ...]
    gen_len: int
    log_mass: tuple[tuple[float, ...], ...] | None = None
    off_top_k: tuple[int, int] | None = None
    tuned_for: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.layers, (tuple, list)) or not self.layers or \
                not all(isinstance(x, bool) for x in self.layers):
            raise ValueError(f"layers must be a non-empty sequence of bools, got {self.layers!r}")
        object.__setattr__(self, "layers", tuple(self.layers))
        check_int("gen_len", self.gen_len, 1)
        if self.log_mass is not None:
            object.__setattr__(self, "log_mass", _log_mass_table(self.log_mass, len(self.layers)))
        if self.off_top_k is not None:
            if not isinstance(self.off_top_k, (tuple, list)) or len(self.off_top_k) != 2:
                raise ValueError(f"off_top_k must be None or a pair (k, k_off), got {self.off_top_k!r}")
            k, k_off = self.off_top_k
            check_int("off_top_k[0]", k, 0)
            check_int("off_top_k[1]", k_off, k)
            object.__setattr__(self, "off_top_k", (k, k_off))
        if not isinstance(self.tuned_for, dict):
            raise TypeError(f"tuned_for must be a dict, got {type(self.tuned_for).__name__}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_layers(self, num_layers: int, num_q_heads: int | None = None) -> None:
        """``ValueError`` unless the gate has one entry per layer of a ``num_layers``-layer model and (given
        ``num_q_heads``) its ``log_mass`` one per query head."""
        if self.num_layers != num_layers:
            raise ValueError(f"the completion gate has {self.num_layers} layers, the model {num_layers}")
        if num_q_heads is not None and self.log_mass is not None and len(self.log_mass[0]) != num_q_heads:
            raise ValueError(f"the completion gate's log_mass has {len(self.log_mass[0])} heads per layer, the "
                             f"model {num_q_heads} query heads")

    def log_mass_tensors(self, device=None) -> list:
        """Per layer the ``log_mass [Hq]`` fp32 tensor on ``device`` that ``gated_log_phi_q`` adds, or None
        (no correction); made once by a backend, so a captured decode step copies nothing from the host."""
        if self.log_mass is None:
            return [None] * self.num_layers
        import torch

        return [torch.tensor(row, dtype=torch.float32, device=device) for row in self.log_mass]

    def to_dict(self) -> dict:
        d = {"kind": GATE_KIND, "layers": list(self.layers), "gen_len": self.gen_len}
        if self.log_mass is not None:
            d["log_mass"] = [list(row) for row in self.log_mass]
        if self.off_top_k is not None:
            d["off_top_k"] = list(self.off_top_k)
        return {**d, "tuned_for": self.tuned_for}

    @classmethod
    def from_dict(cls, d: dict) -> "CompletionGate":
        if not isinstance(d, dict) or d.get("kind") != GATE_KIND:
            raise ValueError(f"not a completion gate (kind must be {GATE_KIND!r}), got "
                             f"{d.get('kind') if isinstance(d, dict) else type(d).__name__!r}")
        unknown = set(d) - {"kind", "layers", "gen_len", "log_mass", "off_top_k", "tuned_for"}
        missing = {"layers", "gen_len"} - set(d)
        if unknown or missing:
            raise ValueError(f"completion gate fields: unknown {sorted(unknown)}, missing {sorted(missing)}")
        return cls(layers=tuple(d["layers"]), gen_len=d["gen_len"], log_mass=d.get("log_mass"),
                   off_top_k=d.get("off_top_k"), tuned_for=d.get("tuned_for", {}))

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


def _log_mass_table(rows, num_layers: int) -> tuple[tuple[float, ...], ...]:
    """``rows`` checked as ``num_layers`` equal-length, non-empty sequences of finite numbers -> tuples of floats."""
    ok = isinstance(rows, (tuple, list)) and len(rows) == num_layers and all(
        isinstance(r, (tuple, list)) and r and len(r) == len(rows[0]) for r in rows)
    if ok:
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for r in rows for x in r)
    if not ok:
        raise ValueError(f"log_mass must hold, per layer ({num_layers}), the same number (>= 1) of finite floats "
                         f"(one per query head), got {rows!r}")
    return tuple(tuple(float(x) for x in r) for r in rows)
