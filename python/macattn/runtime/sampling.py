"""Per-request sampling parameters (TensorRT-LLM names) and the batched sampler.

Greedy iff ``top_k == 1`` or (``top_k == 0`` and ``top_p == 0``), as in TensorRT-LLM;
otherwise logits are divided by ``temperature``, cut to the tokens whose probability is at least
``min_p`` times the largest (0 = no cut), to the ``top_k`` largest (0 = no cut) and to the smallest
set with cumulative probability ``>= top_p`` (0 = no cut; values tied with the last kept one are
kept), then one token is drawn.

Before that (vLLM v1's order; greedy rows take the argmax of the result) each row's logits are
processed: tokens banned while fewer than ``min_tokens`` were generated (``end_id`` and
``stop_token_ids``) get ``-inf``, ``logit_bias`` is added, then the penalties: ``repetition_penalty``
(HF / vLLM: the logit of a token seen in the prompt or the output is divided by it when positive,
multiplied when not), ``frequency_penalty`` (times the token's count among the generated tokens) and
``presence_penalty`` (once if generated at all) are subtracted (OpenAI). The counts live in a
runtime-owned per-slot tensor (``TokenCounts``) updated inside the step.

``sample_tokens`` samples a whole batch on the logits' device with no host synchronisation and
static shapes, so it runs inside the decode step's CUDA graph. The draw is the Gumbel-max trick over
counter-based uniforms: row ``b``'s noise is a hash of (its request's ``seed``, the position being
generated, the token id) — a request's tokens depend on its seed and its own logits only, never on
the batch it ran in, the device's RNG state or how many graphs were replayed before.
"""
from __future__ import annotations

import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["SamplingConfig", "SamplingRow", "SamplingBatch", "SamplerVariant", "PAD_ROW", "TokenCounts",
           "process_logits", "sample_tokens", "MAX_LOGIT_BIAS", "MAX_STOP_TOKEN_IDS", "BIAS_WIDTH", "MAX_SEED"]

MAX_LOGIT_BIAS = 64
"""Entries of one request's ``logit_bias`` at most (the sampler's bias table is padded to a fixed width)."""
MAX_STOP_TOKEN_IDS = 16
"""Ids of one request's ``stop_token_ids`` at most."""
BIAS_WIDTH = MAX_LOGIT_BIAS + 1 + MAX_STOP_TOKEN_IDS
"""Columns of the bias table of a CUDA batch bucket: the logit biases, then ``end_id`` and the stop ids
(``-inf`` while ``min_tokens`` is not reached)."""
MAX_SEED = (1 << 63) - 1
"""The largest ``random_seed`` (an int64)."""
DIVISOR_RANGE = (1e-6, 1e6)
"""The range of ``temperature`` and ``repetition_penalty`` (logits are divided by them in fp32: outside it a
row overflows to inf / NaN)."""
# the parameters that are per-row columns of a batch (``SamplingBatch``), in ``SamplingConfig._scalars`` order
_PARAM_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_real(name: str, value, lo: float, hi: float, *, lo_open: bool = False, what: str = "") -> float:
    """``value`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``), else an error naming ``name``."""
    rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f"> {lo:g}"
    if not _is_real(value):
        raise TypeError(f"{name} must be a float {rng}{what}, got {type(value).__name__} {value!r}")
    ok = math.isfinite(value) and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        raise ValueError(f"{name} must be a finite float {rng}{what}, got {value}")
    return float(value)


@dataclass(frozen=True)
class SamplingConfig:
    """One request's sampling and stopping parameters as the engine runs them (TensorRT-LLM's runtime name;
    users write ``macattn.SamplingParams``, which builds one; ranges checked here, each error naming its field):

    max_new_tokens: tokens to generate, int >= 1. end_id: stop token (not emitted), None = none.
    temperature: float in ``DIVISOR_RANGE`` ([1e-6, 1e6]). top_k: int in [0, 2^63 - 1]. top_p: float in [0, 1]. random_seed: int in [0, 2^63 - 1]
    or None (a fresh seed per request). min_p: float in [0, 1] (0 = off). repetition_penalty: float in
    ``DIVISOR_RANGE`` (1 = off). presence_penalty / frequency_penalty: float in [-2, 2] (0 = off). logit_bias: a mapping
    (or pairs) token id (int >= 0) -> bias (float in [-100, 100]), at most ``MAX_LOGIT_BIAS`` entries;
    kept as pairs sorted by id. min_tokens: int in [0, max_new_tokens]: ``end_id`` and
    ``stop_token_ids`` cannot be generated before that many tokens. stop_token_ids: ints >= 0 (at most
    ``MAX_STOP_TOKEN_IDS``): generating one ends the request after it (it is emitted, unlike ``end_id``).
    prompt_logprobs: None or k >= 0: the log-probability of every prompt token given its prefix and the
    ``k`` most likely tokens at each position (``StepOutput.prompt_logprobs``). Token ids are checked
    against the vocabulary by the engine (``LLMEngine.make_request``)."""

    max_new_tokens: int = 1
    end_id: int | None = None
    temperature: float = 1.0
    top_k: int = 1
    top_p: float = 0.0
    random_seed: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens):
            raise TypeError(f"max_new_tokens must be an int >= 1, got {type(self.max_new_tokens).__name__} "
                            f"{self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens}")
        if self.end_id is not None and not _is_int(self.end_id):
            raise TypeError(f"end_id must be an int or None, got {type(self.end_id).__name__} {self.end_id!r}")
        _check_real("temperature", self.temperature, *DIVISOR_RANGE)
        if not _is_int(self.top_k):
            raise TypeError(f"top_k must be an int >= 0, got {type(self.top_k).__name__} {self.top_k!r}")
        if not 0 <= self.top_k <= MAX_SEED:      # the sampler holds it as int64
            raise ValueError(f"top_k must be an int in [0, 2^63 - 1] (0 = no top-k cut), got {self.top_k}")
        if not _is_real(self.top_p):
            raise TypeError(f"top_p must be a float in [0, 1], got {type(self.top_p).__name__} {self.top_p!r}")
        if not (math.isfinite(self.top_p) and 0.0 <= self.top_p <= 1.0):
            raise ValueError(f"top_p must be a float in [0, 1] (0 = no top-p cut), got {self.top_p}")
        if self.random_seed is not None and (not _is_int(self.random_seed) or not 0 <= self.random_seed <= MAX_SEED):
            raise ValueError(f"random_seed must be an int in [0, 2^63 - 1] or None, got {self.random_seed!r}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", _check_real("min_p", self.min_p, 0.0, 1.0, what=" (0 = off)"))
        object.__setattr__(self, "repetition_penalty", _check_real(
            "repetition_penalty", self.repetition_penalty, *DIVISOR_RANGE, what=" (1 = off)"))
        for name in ("presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, _check_real(name, getattr(self, name), -2.0, 2.0, what=" (0 = off)"))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_tokens!r}")
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            raise ValueError(f"prompt_logprobs must be None or an int >= 0 (the top-k per position), "
                             f"got {self.prompt_logprobs!r}")
        # read per row and step by the batch builders: computed once
        greedy = self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0)
        penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        biased = bool(self.logit_bias) or (self.min_tokens > 0 and (self.end_id is not None or bool(self.stop_token_ids)))
        object.__setattr__(self, "_flags", (greedy, penalized, biased))
        object.__setattr__(self, "_scalars", tuple(getattr(self, name) for name in _PARAM_COLUMNS))

    @property
    def greedy(self) -> bool:
        """No random draw: the argmax of the processed logits."""
        return self._flags[0]

    @property
    def penalized(self) -> bool:
        """Whether a penalty is on (the sampler then reads the request's token counts)."""
        return self._flags[1]

    @property
    def biased(self) -> bool:
        """Whether the bias table has entries for this request at some step (``logit_bias``, ``min_tokens``)."""
        return self._flags[2]

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process: the argmax of the raw logits (today's greedy step)."""
        return self.greedy and not self.penalized and not self.biased

    def bias_entries(self, generated: int) -> list[tuple[int, float]]:
        """The bias table's entries when ``generated`` tokens were generated: ``logit_bias``, then ``-inf``
        for ``end_id`` and ``stop_token_ids`` while ``generated < min_tokens``."""
        out = list(self.logit_bias)
        if generated < self.min_tokens:
            ban = ([self.end_id] if self.end_id is not None else []) + list(self.stop_token_ids)
            out += [(t, float("-inf")) for t in ban]
        return out

    def make_seed(self) -> int:
        """The request's sampling seed: ``random_seed``, or a fresh random one."""
        return self.random_seed if self.random_seed is not None else secrets.randbits(62)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    what = f"logit_bias must map token ids (int >= 0) to biases (float in [-100, 100]), at most {MAX_LOGIT_BIAS}"
    if value is None:
        return ()
    try:
        pairs = list(value.items()) if isinstance(value, Mapping) else [tuple(p) for p in value]
    except TypeError:
        raise TypeError(f"{what}; got {type(value).__name__} {value!r}") from None
    if len(pairs) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    out: dict[int, float] = {}
    for p in pairs:
        if len(p) != 2 or not _is_int(p[0]) or p[0] < 0:
            raise ValueError(f"{what}; got the entry {p!r}")
        if p[0] in out:
            raise ValueError(f"logit_bias lists token {p[0]} twice")
        out[p[0]] = _check_real(f"logit_bias[{p[0]}]", p[1], -100.0, 100.0)
    return tuple(sorted(out.items()))


def _stop_token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"stop_token_ids must be a sequence of ints >= 0, got {type(value).__name__} {value!r}")
    ids = list(value)
    if any(not _is_int(t) or t < 0 for t in ids):
        raise ValueError(f"stop_token_ids must be ints >= 0, got {ids!r}")
    ids = list(dict.fromkeys(ids))
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are accepted")
    return tuple(ids)


class SamplingRow(NamedTuple):
    """One batch row: the request's ``params`` and ``seed``, the ``position`` of the token being generated
    and how many tokens it ``generated`` before (``min_tokens``)."""

    params: SamplingConfig
    seed: int
    position: int
    generated: int = 0


PAD_ROW = SamplingRow(SamplingConfig(), 0, 0)   # a padding row: greedy, nothing to process


class SamplerVariant(NamedTuple):
    """What a batch's sampler runs (a static choice: one captured graph each on CUDA): ``draw`` (some row
    samples; else the argmax only), ``bias`` (the bias table is added), ``penalize`` (the penalties: the
    rows' ``TokenCounts`` are read, and the step's tokens counted). ``(False, False, False)``: the argmax
    of the raw logits."""

    draw: bool
    bias: bool
    penalize: bool

    @staticmethod
    def of(params: list[SamplingConfig]) -> "SamplerVariant":
        if not params:
            return SamplerVariant(False, False, False)
        greedy, penalized, biased = zip(*[p._flags for p in params])
        return SamplerVariant(not all(greedy), any(biased), any(penalized))


# the per-row scalar columns of a batch and their dtypes
_COLUMNS = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32, "seed": torch.int64,
            "position": torch.int64, "min_p": torch.float32, "repetition_penalty": torch.float32,
            "presence_penalty": torch.float32, "frequency_penalty": torch.float32}


def columns(rows: list[SamplingRow]) -> dict[str, tuple]:
    """The scalar columns of ``rows`` (``SamplingBatch``'s names, ``position`` included)."""
    if not rows:
        return {name: () for name in _COLUMNS}
    cols = dict(zip(_PARAM_COLUMNS, zip(*[r.params._scalars for r in rows])))
    cols["seed"] = tuple(r.seed for r in rows)
    cols["position"] = tuple(r.position for r in rows)
    return cols


def bias_row(row: SamplingRow, width: int) -> tuple[list[int], list[float]]:
    """Row ``row``'s bias table entries padded to ``width`` (padding: token 0, bias 0 — a no-op)."""
    entries = row.params.bias_entries(row.generated)
    if len(entries) > width:
        raise ValueError(f"a request has {len(entries)} bias entries; the table holds {width}")
    pad = width - len(entries)
    return [t for t, _ in entries] + [0] * pad, [b for _, b in entries] + [0.0] * pad


@dataclass(frozen=True)
class SamplingBatch:
    """One step's per-row sampling inputs, on the logits' device: ``[B]`` temperature fp32, top_k int64,
    top_p fp32, seed int64, position int64 (of the token being generated), min_p fp32,
    repetition_penalty / presence_penalty / frequency_penalty fp32; the bias table ``[B, K]``: bias_ids
    int64, bias_values fp32 (added to the logits; padding entries are token 0 with bias 0)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    position: torch.Tensor
    min_p: torch.Tensor
    repetition_penalty: torch.Tensor
    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor

    @staticmethod
    def of(rows: list, device, pad_to: int | None = None, bias_width: int | None = None) -> "SamplingBatch":
        """``rows``: a ``SamplingRow`` (or ``(params, seed, position[, generated])``) per request; padded
        (``PAD_ROW``) to ``pad_to``; the bias table ``bias_width`` wide (None: the widest row's)."""
        n = len(rows) if pad_to is None else pad_to
        rows = [SamplingRow(*r) for r in rows] + [PAD_ROW] * (n - len(rows))
        cols = columns(rows)
        t = {name: torch.tensor(cols[name], dtype=dt) for name, dt in _COLUMNS.items()}
        if bias_width is None:
            bias_width = max((len(r.params.bias_entries(r.generated)) for r in rows), default=0)
        table = [bias_row(r, bias_width) for r in rows]
        t["bias_ids"] = torch.tensor([i for i, _ in table], dtype=torch.int64).view(n, bias_width)
        t["bias_values"] = torch.tensor([v for _, v in table], dtype=torch.float32).view(n, bias_width)
        return SamplingBatch(**{k: v.to(device, non_blocking=True) for k, v in t.items()})


class TokenCounts:
    """The penalties' per-slot token statistics (a per-slot state of the slot registry): ``data``
    ``[num_slots, V]`` int32, entry ``2 * (times the token was generated) + (1 if it is in the prompt)``.

    One packed int32 per (slot, token): the sampler gathers one ``[B, V]`` row block per step and a step
    adds its ``B`` tokens with one scatter (O(B), no history scan); ``V = 128K`` over 16 slots is 8 MB.
    Allocated on first use (``ensure``: the first request with a penalty), so an engine whose requests
    never ask for one holds nothing; never reallocated (captured steps keep its address). Rows are
    zeroed on reset (admission, release) and copied for a forked request (``copy``)."""

    def __init__(self, num_slots: int, vocab_size: int, device) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, torch.device(device)
        self.data: torch.Tensor | None = None

    @property
    def allocated(self) -> bool:
        return self.data is not None

    def ensure(self) -> torch.Tensor:
        if self.data is None:
            with torch.inference_mode(False):     # a normal tensor: reset / copy run outside inference mode too
                self.data = torch.zeros(self.num_slots, self.vocab_size, dtype=torch.int32, device=self.device)
        return self.data

    def reset(self, slot: int) -> None:
        if self.data is not None:
            self.data[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        if self.data is not None:
            self.data[dst].copy_(self.data[src])

    def add_prompt(self, slot: int, ids: list[int]) -> None:
        """Mark the prompt's tokens ``ids`` in ``slot`` (before its first token is sampled)."""
        row = self.ensure()[slot]
        idx = torch.tensor(sorted(set(ids)), dtype=torch.int64).to(self.device, non_blocking=True)
        row.index_copy_(0, idx, row.index_select(0, idx) | 1)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``[B, V]`` int32: the rows of ``slots [B]`` (device ops only)."""
        return self.ensure().index_select(0, slots)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Count each row's generated ``tokens [B]`` in its slot (rows with ``valid == 0`` add nothing);
        device ops only (capturable)."""
        data = self.ensure()
        add = torch.full_like(tokens, 2, dtype=torch.int32) if valid is None else (valid > 0).to(torch.int32) * 2
        data.view(-1).index_add_(0, slots.to(tokens.device) * self.vocab_size + tokens, add)


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds) of int64 ``x`` in ``[0, 2^32)``; the
    multiplier is below 2^27 so no product overflows int64."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _uniforms(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, V]`` fp32 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    key = _mix32((seed & _M32) ^ _mix32(((seed >> 32) & _M32) ^ _mix32(position & _M32)))
    ids = _mix32(torch.arange(vocab, device=seed.device, dtype=torch.int64))
    bits = _mix32(key[:, None] ^ ids[None, :]) >> 8                     # 24 bits: exact in fp32
    return (bits.float() + 0.5) * (1.0 / (1 << 24))


def process_logits(logits: torch.Tensor, batch: SamplingBatch, *, use_bias: bool = True,
                   counts: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` with the bias table added (``use_bias``; ``-inf`` bans included) and, given the
    rows' ``counts [B, V]`` (``TokenCounts.rows``), the penalties applied; in ``logits``' dtype promoted
    to at least fp32. A row with every default gets its logits back exactly (upcast)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if use_bias and batch.bias_ids.shape[1]:
        x = x.scatter_add(1, batch.bias_ids, batch.bias_values.to(x.dtype))
    if counts is not None:
        if counts.shape != x.shape:
            raise ValueError(f"token counts {tuple(counts.shape)} do not match the logits {tuple(x.shape)}")
        rp = batch.repetition_penalty.to(x.dtype)[:, None]
        x = torch.where(counts != 0, torch.where(x > 0, x / rp, x * rp), x)
        generated = (counts >> 1).to(x.dtype)
        x = (x - batch.frequency_penalty.to(x.dtype)[:, None] * generated
             - batch.presence_penalty.to(x.dtype)[:, None] * (counts > 1).to(x.dtype))
    return x


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch, *, greedy_only: bool = False, use_bias: bool = True,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
    """Next token ids ``[B]`` int64 from ``logits [B, V]`` (any float dtype) under each row's parameters
    (``process_logits`` first: the bias table unless ``use_bias`` is False or it has no column, the
    penalties when ``counts`` is given). ``greedy_only``: every row is greedy (argmax only; the caller
    knows). No host sync, static shapes."""
    if (use_bias and batch.bias_ids.shape[1]) or counts is not None:
        logits = process_logits(logits, batch, use_bias=use_bias, counts=counts)
    best = logits.argmax(dim=-1)
    if greedy_only:
        return best
    V = logits.shape[-1]
    x = logits.float() / batch.temperature[:, None]
    probs = torch.softmax(x, dim=-1)
    x = x.masked_fill(probs < batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))
    ordered = x.sort(dim=-1, descending=True).values
    rank = torch.arange(V, device=x.device)
    k = torch.where(batch.top_k > 0, batch.top_k, V)
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(ordered.masked_fill(~keep, float("-inf")), dim=-1)
    use_p = (batch.top_p > 0) & (batch.top_p < 1)
    keep &= ~use_p[:, None] | ((probs.cumsum(-1) - probs) < batch.top_p[:, None])
    last_kept = ordered.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    gumbel = -torch.log(-torch.log(_uniforms(batch.seed, batch.position, V)))
    drawn = (x.masked_fill(x < last_kept, float("-inf")) + gumbel).argmax(dim=-1)
    greedy = (batch.top_k == 1) | ((batch.top_k == 0) & (batch.top_p == 0))
    return torch.where(greedy, best, drawn)
