"""``EngineArgs``: one options object for every surface that builds an engine (vLLM's ``EngineArgs`` /
``add_cli_args`` / ``create_engine_config``, sglang's ``ServerArgs``).

``LLM(model, **kwargs)``, ``macattn serve --model`` (its flags are ``EngineArgs.add_cli_args``),
``macattn triton-repo`` (the repository's models carry one ``engine_args`` JSON parameter) and
``ModelRunner.from_hf`` all build their engine through it, so a field means the same everywhere:
``mac=None`` is MAC with its defaults (on), ``use_cuda_graphs=None`` is on exactly on CUDA, every MAC flag
(``mac`` file, ``mac_tau``, ``mac_window``, ``mac_band``, ``mac_min_context``) exists on every surface, and
``mac_min_context=None`` engages MAC from ``DEFAULT_CUDA_MIN_CONTEXT`` on CUDA (where full attention is faster
below it), from the first step elsewhere.

    args = EngineArgs(model="builtin", device="cuda", max_batch_size=16)
    engine = args.build_engine()                 # or args.build_engine(model_object)
    EngineArgs.from_json(args.to_json()) == args

Each field's help text is its docstring (the string literal under it), read once from this source.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
import math
import os
import textwrap
from dataclasses import MISSING, asdict, dataclass, fields, replace
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, get_type_hints

from macattn.methods.mac.config import DEFAULT_CUDA_MIN_CONTEXT, MacConfig
from macattn.models.names import BUILTIN_MODEL, BUILTIN_NAMES

if TYPE_CHECKING:                  # torch and the runtime load when an engine is configured, not with the flags
    import torch

    from macattn.runtime.config import RuntimeConfig

__all__ = ["EngineArgs", "BUILTIN_NAMES", "DTYPES"]

DTYPES = {"auto": None, "bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}
"""``dtype`` spellings -> the ``torch`` dtype's name (None: the checkpoint's)."""
_MAC_OFF, _MAC_ON = "off", "on"
_PATH_FIELDS = ("model", "tokenizer", "mac", "completion_maps", "completion_gate", "prefix_store")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")   # any one: a tokenizer
# flag spellings kept beside the generated ``--field-name`` ones
_ALIASES = {"tensor_parallel_size": ("--tp",), "mac": ("--per-layer",), "mac_tau": ("--tau",),
            "mac_window": ("--window",), "mac_band": ("--band",), "mac_min_context": ("--min-context",),
            "max_seq_len": ("--max-model-len",)}


@dataclass(frozen=True)
class EngineArgs:
    """Everything that configures an engine (module doc). Validated on construction (``ValueError`` /
    ``TypeError`` naming the field and its accepted values)."""

    model: str = BUILTIN_MODEL
    """'builtin' (the packaged trained checkpoint; also 'trained', 'tiny-llama') or a transformers model directory"""
    tokenizer: str | None = None
    """tokenizer directory (default: the model's)"""
    dtype: str = "auto"
    """weights' dtype: auto (the checkpoint's), bfloat16, float16 or float32"""
    trust_remote_code: bool = False
    """let transformers run code shipped with a model directory (local files only; nothing is downloaded)"""
    device: str = "cpu"
    """torch device of weights, KV pool and method state (cpu runs the reference ops; cuda the kernels)"""
    method: str = "mac"
    """attention method: mac, full, completion or completion_offload"""
    mac: str | dict | None = None
    """MAC's configuration: None or 'on' = MAC's defaults, 'off' = MAC disabled (full attention through its ops), a
    MacConfig JSON file (per-layer, from macattn tune), or a MacConfig's dict (MacConfig.to_dict())"""
    mac_tau: float | None = None
    """MAC match threshold in [0, 1) over the file's / default global value"""
    mac_window: int | None = None
    """MAC ring capacity K >= 1 over the file's / default global value"""
    mac_band: int | None = None
    """MAC rectification band r >= 0 over the file's / default global value"""
    mac_min_context: int | None = None
    """MAC engages at decode positions >= this (below: full attention, rings untouched); None = the file's value
    where it sets one, else DEFAULT_CUDA_MIN_CONTEXT (8192, the measured crossover) on CUDA and 0 elsewhere"""
    completion_maps: str | None = None
    """method completion: distilled feature maps directory (default: untrained init)"""
    completion_gate: str | None = None
    """method completion: per-layer gate of the completion term, a JSON file from macattn tune --completion
    (default: the term in every layer)"""
    kv_offload: str | None = None
    """method completion: 'host' keeps the prompt KV in host memory and fetches the selected pages per step"""
    prefix_store: str | None = None
    """method completion with kv_offload host: directory where prompts' KV persist (requests ask reuse_prefix)"""
    prefix_store_max_bytes: int | None = None
    """bound of the prefix store in bytes: least recently used entries are evicted past it, and no entry larger
    than it is read (default: unbounded)"""
    max_batch_size: int = 8
    """requests decoded together at most (state slots)"""
    max_seq_len: int | None = None
    """prompt + generated tokens per request at most (default: the model's max_position_embeddings)"""
    block_size: int = 16
    """tokens per paged KV block"""
    num_blocks: int | None = None
    """KV blocks in the pool (default: enough for max_batch_size requests of max_seq_len)"""
    max_num_batched_tokens: int | None = None
    """token budget of one engine step: the running decodes plus prompt chunks packed into one model call
    (default: 8192 on CUDA, whole prompts on the CPU)"""
    max_prefill_tokens: int | None = None
    """token budget of a step in which no request decodes (default: 32768 on CUDA, max_num_batched_tokens
    elsewhere)"""
    use_cuda_graphs: bool | None = None
    """capture decode steps as CUDA graphs (default: on exactly on CUDA)"""
    fused_weights: bool = True
    """fused Q/K/V and gate/up weights with the decode-step kernels"""
    quantization: str | None = None
    """weight-only quantisation of the projections: fp8 (needs fused_weights)"""
    tensor_parallel_size: int = 1
    """ranks (processes) the model is sharded over"""
    tp_timeout_s: float = 120.0
    """seconds a tensor-parallel collective may wait before the group is declared dead"""
    gpu_memory_utilization: float | None = None
    """on CUDA, the share of the GPU's memory in (0, 1] the engine may fill: with num_blocks unset the KV pool gets
    (this x total - memory in use - the weights still to load) / bytes per block, at most what max_batch_size
    requests of max_seq_len need (default: that maximum); accepted and unused on the CPU"""
    enable_prefix_caching: bool | None = None
    """automatic prefix caching (vLLM's flag): a request whose prompt starts with full KV blocks an earlier request
    prefilled reuses them and prefills only the rest; None = on where the method supports it (mac, full), True
    where it does not is refused naming the method"""
    async_scheduling: bool | None = None
    """launch each engine step before reading the previous step's tokens, so the host's work between steps
    overlaps the GPU's (vLLM's async scheduling); None = on exactly on CUDA without tensor parallelism"""
    seed: int | None = None
    """seed of the per-request sampling seeds: a request that gives none gets the next draw of a generator seeded
    with it, so a run repeats exactly (default: a fresh random seed per request)"""

    def __post_init__(self) -> None:
        for name in _PATH_FIELDS:                      # a path given as a Path: kept as its string (JSON)
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for f in fields(self):
            _check_type(f.name, getattr(self, f.name), _hints()[f.name])
        u = self.gpu_memory_utilization
        if u is not None and not (math.isfinite(u) and 0.0 < u <= 1.0):
            raise ValueError(f"gpu_memory_utilization must be a float in (0, 1] or None, got {u!r}")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed must be an int in [0, 2^63 - 1] or None, got {self.seed!r}")
        if self.prefix_store_max_bytes is not None and self.prefix_store_max_bytes < 1:
            raise ValueError(f"prefix_store_max_bytes must be an int >= 1 or None, got {self.prefix_store_max_bytes}")
        if self.kv_offload not in (None, "host"):
            raise ValueError(f"kv_offload must be None or 'host', got {self.kv_offload!r}")
        if self.method not in ("completion", "completion_offload"):
            given = [n for n in ("completion_maps", "completion_gate", "kv_offload", "prefix_store",
                                 "prefix_store_max_bytes")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{given[0]} is retrieval-completion's option; method={self.method!r} takes none")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        flags = (self.mac_tau, self.mac_window, self.mac_band, self.mac_min_context)
        if self.method != "mac" and any(v is not None for v in (self.mac, *flags)):
            raise ValueError(f"mac / mac_tau / mac_window / mac_band / mac_min_context configure MAC; "
                             f"method={self.method!r} takes none")
        if self.mac == _MAC_OFF and any(v is not None for v in flags):
            raise ValueError("mac='off' takes no mac_tau / mac_window / mac_band / mac_min_context")
        self.runtime_config()               # the runtime's own checks, now
        if self.method == "mac":
            self.mac_config()

    # --- the parts -----------------------------------------------------------------------------
    @property
    def is_builtin(self) -> bool:
        return self.model in BUILTIN_NAMES

    @property
    def torch_dtype(self) -> torch.dtype | None:
        import torch

        return None if DTYPES[self.dtype] is None else getattr(torch, DTYPES[self.dtype])

    @property
    def _on_cuda(self) -> bool:
        import torch

        return torch.device(self.device).type == "cuda" if _is_device(self.device) else False

    def mac_config(self) -> MacConfig | None:
        """MAC's config (None when the method is not MAC): the file (or the defaults), the explicit global
        values on top; ``MacConfig(enabled=False)`` for ``mac='off'``. ``min_context``: ``mac_min_context``, else
        the file's where it is not 0, else ``DEFAULT_CUDA_MIN_CONTEXT`` on CUDA (0 elsewhere)."""
        if self.method != "mac":
            return None
        if self.mac == _MAC_OFF:
            return MacConfig(enabled=False)
        base = (MacConfig.from_dict(self.mac) if isinstance(self.mac, dict)
                else MacConfig.load(self.mac) if self.mac and self.mac != _MAC_ON else MacConfig())
        min_context = self.mac_min_context
        if min_context is None:
            min_context = base.min_context or (DEFAULT_CUDA_MIN_CONTEXT if self._on_cuda else 0)
        kw = {k: v for k, v in (("tau", self.mac_tau), ("window", self.mac_window), ("band", self.mac_band),
                                ("min_context", min_context)) if v is not None}
        return replace(base, **kw)

    def runtime_config(self) -> RuntimeConfig:
        from macattn.runtime.config import RuntimeConfig

        cuda = self._on_cuda
        return RuntimeConfig(max_batch_size=self.max_batch_size, max_seq_len=self.max_seq_len,
                             block_size=self.block_size, num_blocks=self.num_blocks, device=self.device,
                             use_cuda_graphs=cuda if self.use_cuda_graphs is None else self.use_cuda_graphs,
                             fused_weights=self.fused_weights, quantization=self.quantization,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             max_prefill_tokens=self.max_prefill_tokens,
                             tensor_parallel_size=self.tensor_parallel_size, tp_timeout_s=self.tp_timeout_s,
                             enable_prefix_caching=self.enable_prefix_caching,
                             async_scheduling=self.async_scheduling)

    def load_model(self, *, with_tokenizer: bool = True):
        """``(model, tokenizer)``: the built-in checkpoint or ``AutoModelForCausalLM`` / ``AutoTokenizer`` of
        the model directory (local files only), in ``dtype``; the tokenizer None without ``with_tokenizer``."""
        import torch

        if self.is_builtin:
            from macattn.models.checkpoint import load_builtin_checkpoint

            model, tok = load_builtin_checkpoint(dtype=self.torch_dtype or torch.float32)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM

            from macattn.models.architectures import SUPPORTED_ARCHITECTURES

            path = Path(self.model)
            if not path.is_dir():
                raise ValueError(f"model must be one of {list(BUILTIN_NAMES)} or a local transformers model "
                                 f"directory, got {self.model!r} (nothing is downloaded)")
            hf = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=self.trust_remote_code)
            archs = list(getattr(hf, "architectures", None) or [])
            if not set(archs) & set(SUPPORTED_ARCHITECTURES):
                raise ValueError(f"model {self.model}: unsupported architecture {', '.join(archs) or '(none named)'} "
                                 f"(model_type {hf.model_type}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=self.torch_dtype or "auto", attn_implementation="sdpa", local_files_only=True,
                trust_remote_code=self.trust_remote_code).eval()
            tok = None
        if not with_tokenizer:
            return model, None
        if self.tokenizer is not None or tok is None:
            from transformers import AutoTokenizer

            where = Path(self.tokenizer or self.model)
            if where.is_dir() and not any((where / f).is_file() for f in _TOKENIZER_FILES):
                raise FileNotFoundError(f"{'tokenizer' if self.tokenizer else 'model'} directory {where} holds no "
                                        f"tokenizer (none of {', '.join(_TOKENIZER_FILES)}); give tokenizer=DIR "
                                        f"(--tokenizer)")
            tok = AutoTokenizer.from_pretrained(self.tokenizer or self.model, local_files_only=True,
                                                trust_remote_code=self.trust_remote_code)
        return model, tok

    def build_engine(self, model=None, *, completion=None, offload=None, method_config=None,
                     method_kwargs: dict | None = None):
        """The ``LLMEngine`` these args describe, over ``model`` (a ``*ForCausalLM`` object, bound in place) or,
        when None, the model ``load_model`` loads. Options that are Python objects, not JSON: ``completion``
        (a ``CompletionConfig``) and ``offload`` (an ``OffloadConfig``) of retrieval-completion; or, for any
        other registered method, its ``method_config`` / ``method_kwargs`` as given. On CUDA with
        ``use_cuda_graphs`` every decode bucket's step and every prefill bucket's pieces are captured here."""
        from macattn.runtime.completion_setup import completion_method
        from macattn.runtime.engine import LLMEngine

        if model is None:
            model = self.load_model(with_tokenizer=False)[0]
        elif self.torch_dtype is not None:
            model = model.to(self.torch_dtype)
        mac = self.method == "mac"
        name = self.method
        if method_config is None and method_kwargs is None:     # the options given as args
            completion_like = self.method in ("completion", "completion_offload")
            name, method_config, method_kwargs = completion_method(
                model, "completion" if completion_like else self.method, completion=completion,
                maps=self.completion_maps, gate=self.completion_gate, offload=offload, prefix_store=self.prefix_store,
                prefix_store_max_bytes=self.prefix_store_max_bytes,
                kv_offload="host" if self.method == "completion_offload" else self.kv_offload)
        config = self.runtime_config()
        blocks = self.kv_blocks_from_memory(model)
        if blocks is not None:
            config = replace(config, num_blocks=blocks)
        engine = LLMEngine(model, self.mac_config() if mac else None, config, method=name,
                           method_config=None if mac else method_config, method_kwargs=method_kwargs)
        engine.executor.prewarm_graphs()   # every CUDA graph now, on every rank (vLLM's start-up capture)
        return engine

    def kv_blocks_from_memory(self, model) -> int | None:
        """KV blocks of ``gpu_memory_utilization`` (its field doc) for ``model`` on this CUDA device; None when it
        does not apply (unset, ``num_blocks`` given, or not CUDA). Each of ``tensor_parallel_size`` ranks holds
        its share of the KV heads and weights; activations and method state come out of the remainder."""
        import torch

        u = self.gpu_memory_utilization
        if u is None or self.num_blocks is not None or not _is_device(self.device) \
                or torch.device(self.device).type != "cuda":
            return None
        cfg, tp = model.config, self.tensor_parallel_size
        free, total = torch.cuda.mem_get_info(torch.device(self.device))
        params = list(model.parameters())
        dtype = self.torch_dtype or params[0].dtype
        pending = sum(p.numel() for p in params if p.device.type != "cuda") * dtype.itemsize // tp
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = -(-(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) // tp)
        per_block = 2 * cfg.num_hidden_layers * kv_heads * head_dim * self.block_size * dtype.itemsize
        room = u * total - (total - free) - pending
        if room < per_block:
            raise ValueError(f"gpu_memory_utilization={u}: {u * total / 2 ** 30:.2f} GiB of {total / 2 ** 30:.2f} GiB "
                             f"leave no room for a KV block ({(total - free) / 2 ** 30:.2f} GiB in use, "
                             f"{pending / 2 ** 30:.2f} GiB of weights to load); raise it or free memory")
        seq_len = self.max_seq_len or cfg.max_position_embeddings
        return min(int(room // per_block), self.max_batch_size * -(-seq_len // self.block_size))

    @classmethod
    def of_runtime(cls, config: RuntimeConfig, **kwargs) -> "EngineArgs":
        """The args of a ``RuntimeConfig`` (its fields are engine args) plus ``kwargs``."""
        return cls(**{**{f.name: getattr(config, f.name) for f in fields(config)}, **kwargs})

    # --- JSON and the command line ---------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "EngineArgs":
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError(f"engine args must be a JSON object, got {text[:200]!r}")
        unknown = sorted(set(doc) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown engine args {unknown}; accepted: {[f.name for f in fields(cls)]}")
        return cls(**doc)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineArgs":
        """``EngineArgs(**kwargs)`` with an unknown keyword named in the ``TypeError``."""
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unexpected engine argument(s) {unknown}; accepted: {[f.name for f in fields(cls)]}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """One flag per field (``--field-name``, plus the aliases in ``_ALIASES``), typed from the annotation,
        help from the field's docstring; every default None so ``from_cli_args`` keeps the dataclass defaults."""
        group = parser.add_argument_group("engine", "engine arguments (EngineArgs)")
        for f in fields(cls):
            if f.name in skip:
                continue
            hint = _hints()[f.name]
            flags = ("--" + f.name.replace("_", "-"), *_ALIASES.get(f.name, ()))
            default = None if f.default is MISSING else f.default
            help_ = _docs().get(f.name, "") + ("" if default is None else f" (default: {default})")
            if _base(hint) is bool:
                group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_)
            else:
                group.add_argument(*flags, dest=f.name, type=_base(hint), default=None, help=help_)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineArgs":
        """The args of parsed flags (those left unset keep their defaults), then ``overrides``."""
        kw = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**{**kw, **overrides})


def _is_device(text: str) -> bool:
    import torch

    try:
        torch.device(text)
        return True
    except (RuntimeError, TypeError):
        return False


def _base(hint) -> type:
    """``int`` of ``int | None`` and the like."""
    args = [a for a in getattr(hint, "__args__", (hint,)) if a is not type(None)]
    return args[0]


def _check_type(name: str, value, hint) -> None:
    allowed = list(getattr(hint, "__args__", (hint,)))
    if value is None:
        if type(None) not in allowed:
            raise TypeError(f"{name} must not be None")
        return
    types = [a for a in allowed if a is not type(None)]
    ok = any(isinstance(value, t) and not (t in (int, float) and isinstance(value, bool))
             or (t is float and isinstance(value, int) and not isinstance(value, bool)) for t in types)
    if not ok:
        names = " or ".join(t.__name__ for t in types) + (" or None" if type(None) in allowed else "")
        raise TypeError(f"{name} must be {names}, got {type(value).__name__} {value!r}")


@lru_cache(maxsize=None)
def _hints() -> dict:
    return get_type_hints(EngineArgs)


@lru_cache(maxsize=None)
def _docs() -> dict[str, str]:
    """Each field's docstring: the string literal right after its annotated assignment."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(EngineArgs)))
    body = tree.body[0].body
    out = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            out[node.target.id] = " ".join(str(nxt.value.value).split())
    return out
