"""Train the built-in tiny LLaMA checkpoint (``transformers.LlamaForCausalLM``, SDPA, bf16 autocast).

    python3 training/train_tiny_llama.py --data .data/tiny_llama --out $OUT/ckpt --time-budget 420

The model is LLaMA-architecture (RMSNorm, RoPE, SwiGLU, GQA, tied embeddings). ``--out`` receives
what ``save_pretrained`` writes (``config.json``, ``model.safetensors`` in bf16,
``generation_config.json``) plus ``tokenizer.json`` and ``train_log.json`` (loss curve, held-out
loss, teacher-forced task accuracy, tokens seen, device, versions).

Data: ``--data`` from ``training/prep_data.py``. Each batch mixes plain text with synthetic
long-context retrieval samples (``macattn/evaluation/tasks.py``: single/multi-key needles,
variable tracking, common words) over a length curriculum up to ``--max-len``. The schedule
(curriculum phases, LR) follows elapsed wall-clock over ``--time-budget`` so the run always
ends with a saved checkpoint.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from macattn.apps.trainer_common import optimizer_step, random_windows, token_cross_entropy, versions

ROOT = Path(__file__).resolve().parents[1]


def load_tasks():
    """The synthetic-task module ``macattn.evaluation.tasks`` (pure standard library)."""
    from macattn.evaluation import tasks

    return tasks


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 1024
    num_hidden_layers: int = 8
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 16384
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2

    def hf_dict(self) -> dict:
        """The fields of a ``transformers.LlamaConfig`` describing this model."""
        return dict(asdict(self), hidden_act="silu", attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                    initializer_range=0.02)


def build_model(cfg: ModelConfig):
    """A freshly initialised ``transformers.LlamaForCausalLM`` (SDPA attention) for ``cfg``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**cfg.hf_dict(), attn_implementation="sdpa"))


def load_tokens(path: Path) -> torch.Tensor:
    """A 1-D uint16 ``.npy`` token shard as an int64 tensor."""
    arr = np.load(path)
    if arr.dtype != np.uint16 or arr.ndim != 1:
        raise ValueError(f"{path} must hold a 1-D uint16 array, got {arr.dtype} {arr.shape}")
    return torch.from_numpy(arr.astype(np.int64))


def save_checkpoint(model, out: Path, tokenizer_json: Path | None) -> None:
    """Write config.json, model-*.safetensors shards + index (bf16, HF names), generation_config.json,
    tokenizer.json."""
    out.mkdir(parents=True, exist_ok=True)
    # shards of <= 12 MB: the device machine returns files of at most 16 MiB; a bf16 copy, so a snapshot
    # taken mid-training leaves the fp32 master weights alone
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True, max_shard_size="12MB")
    if tokenizer_json is not None and tokenizer_json.exists():
        (out / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())


class Batcher:
    """Draws [B, T] token batches (plus per-token loss weights) mixing text and synthetic tasks."""

    def __init__(self, data: torch.Tensor, lexicon: dict, tasks, bos: int, seed: int, syn_frac: float,
                 answer_weight: float):
        self.data, self.lexicon, self.tasks = data, lexicon, tasks
        self.bos, self.syn_frac, self.answer_weight = bos, syn_frac, answer_weight
        self.rng = random.Random(seed)

    def _text(self, n: int) -> list:
        start = self.rng.randrange(0, max(1, len(self.data) - n))
        chunk = self.data[start:start + n].tolist()
        while len(chunk) < n:  # corpus shorter than n: wrap around
            chunk += self.data[: n - len(chunk)].tolist()
        return chunk

    def row(self, t: int) -> tuple[list, list]:
        if self.rng.random() >= self.syn_frac:
            return [self.bos] + self._text(t), [1.0] * t
        task = self.rng.choice(self.tasks.TASKS)
        length = t + 1
        s = self.tasks.make_sample(task, length, self.rng, self.lexicon.__getitem__,
                                   lambda n, r: self._text(n), bos=[self.bos])
        ids = s.ids + s.answer
        w = [1.0] * (len(s.ids) - 1) + [self.answer_weight] * len(s.answer)
        return ids, w

    def batch(self, b: int, t: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [self.row(t) for _ in range(b)]
        ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
        w = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        if torch.device(device).type == "cuda":  # pinned, so the copy does not wait for the GPU step
            ids, w = ids.pin_memory(), w.pin_memory()
        return ids.to(device, non_blocking=True), w.to(device, non_blocking=True)


def parse_phases(spec: str) -> list[tuple[float, int, int]]:
    """"0.3:1024x64,0.65:4096x16,1:8192x8" -> [(end_fraction, seq_len, batch), ...]."""
    out = []
    for part in spec.split(","):
        end, shape = part.split(":")
        t, b = shape.split("x")
        out.append((float(end), int(t), int(b)))
    if not out or out[-1][0] < 1.0 or any(a[0] >= b[0] for a, b in zip(out, out[1:])):
        raise ValueError(f"--phases must end at 1 with increasing fractions, got {spec!r}")
    return out


@torch.no_grad()
def answer_accuracy(model, tasks, lexicon, val, bos, length, n, device, dtype, seed=1234) -> dict:
    """Teacher-forced exact-match of the answer tokens per task at ``length`` (val haystack)."""
    rng = random.Random(seed)
    b = Batcher(val, lexicon, tasks, bos, seed, 1.0, 1.0)
    acc = {}
    for task in tasks.TASKS:
        ok = 0
        for _ in range(n):
            s = tasks.make_sample(task, length, rng, lexicon.__getitem__, lambda k, r: b._text(k), bos=[bos])
            ids = torch.tensor([s.ids + s.answer], device=device)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(ids[:, :-1]).logits
            pred = logits[0, len(s.ids) - 1:].argmax(-1).tolist()
            ok += int(pred == s.answer)
        acc[task] = ok / n
    return acc


@torch.no_grad()
def heldout_loss(model, val: torch.Tensor, seq_len: int, n: int, device, dtype, seed: int = 4321) -> float:
    """Mean next-token NLL over ``n`` random ``seq_len`` windows of the held-out shard."""
    total = 0.0
    for window in random_windows(val, n, seq_len + 1, torch.Generator().manual_seed(seed)):
        ids = window.unsqueeze(0).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = model(ids[:, :-1]).logits
        total += float(token_cross_entropy(logits.float()[0], ids[0, 1:]))
    return total / n


def _version(pkg: str):
    try:
        from importlib.metadata import version
        return version(pkg)
    except Exception:  # noqa: BLE001 - absent package: report None
        return None


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default=str(ROOT / ".data/tiny_llama"), help="dir from training/prep_data.py")
    p.add_argument("--out", required=True, help="checkpoint dir to write")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds of training before saving")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    p.add_argument("--phases", default="0.25:1024x64,0.55:4096x16,0.85:8192x8,1:16384x4",
                   help="curriculum: end_fraction:seq_len x batch, comma-separated")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--syn-frac", type=float, default=0.5, help="fraction of rows that are synthetic tasks")
    p.add_argument("--answer-weight", type=float, default=4.0, help="loss weight of task answer tokens")
    p.add_argument("--eval-len", type=int, default=8192)
    p.add_argument("--eval-n", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (costs compile time)")
    p.add_argument("--model", default="{}", help="JSON overrides of ModelConfig fields (tests use tiny sizes)")
    p.add_argument("--snapshots", default="", help="fractions of the budget (e.g. 0.25,0.5) at which a checkpoint "
                                                   "is also written to OUT/snapshots/fNNN (recurrence over training)")
    p.add_argument("--stop-after", type=float, default=0.0,
                   help="seconds after which to save OUT/resume.pt and exit (0: never); a later run with "
                        "--resume continues the same schedule (for machines that cap one command's time)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/resume.pt")
    a = p.parse_args(argv)
    snapshots = sorted(float(x) for x in a.snapshots.split(",") if x.strip())
    if any(not 0.0 < f < 1.0 for f in snapshots):
        raise ValueError(f"--snapshots must be fractions in (0, 1), got {a.snapshots!r}")

    t0 = time.time()
    torch.manual_seed(a.seed)
    data_dir, out = Path(a.data), Path(a.out)
    train = load_tokens(data_dir / "train.npy")
    val = load_tokens(data_dir / "val.npy")
    lexicon = json.loads((data_dir / "lexicon.json").read_text())
    tasks = load_tasks()
    overrides = json.loads(a.model)
    cfg = ModelConfig(**overrides)
    if int(train.max()) >= cfg.vocab_size:
        raise ValueError(f"data has token id {int(train.max())} >= vocab_size {cfg.vocab_size}")
    phases = parse_phases(a.phases)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    model = build_model(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    fwd = torch.compile(model) if a.compile else model
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    batcher = Batcher(train, lexicon, tasks, cfg.bos_token_id, a.seed, a.syn_frac, a.answer_weight)

    try:
        from tqdm import tqdm
        bar = tqdm(total=int(a.time_budget), unit="s", mininterval=5)
    except ImportError:  # progress bar is optional
        bar = None
    log, step, tokens, start, last_tick = [], 0, 0, time.time(), 0
    resume_path = out / "resume.pt"
    if a.resume:
        if not resume_path.is_file():
            raise FileNotFoundError(f"--resume: no {resume_path} (written by a run with --stop-after)")
        st = torch.load(resume_path, map_location=device, weights_only=False)
        if a.stop_after and a.stop_after <= st["elapsed"]:
            raise ValueError(f"--stop-after {a.stop_after} must exceed the {st['elapsed']:.0f} s already trained")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        batcher.rng.setstate(st["batcher_rng"])
        torch.set_rng_state(st["torch_rng"].cpu())
        log, step, tokens = st["log"], st["step"], st["tokens"]
        start = time.time() - st["elapsed"]
        last_tick = int(st["elapsed"])
        snapshots = [f for f in snapshots if f > st["elapsed"] / a.time_budget]
        if bar is not None:
            bar.update(last_tick)
    while True:
        elapsed = time.time() - start
        frac = elapsed / a.time_budget
        # snapshots due are written first, also at the last step boundary (budget spent, or --stop-after):
        # a step can be longer than the gap between two fractions on a loaded machine
        while snapshots and frac >= snapshots[0]:
            snap = out / "snapshots" / f"f{round(snapshots.pop(0) * 100):03d}"
            save_checkpoint(model, snap, data_dir / "tokenizer.json")
            (snap / "train_log.json").write_text(json.dumps(dict(step=step, tokens_seen=tokens,
                                                                 seconds=round(elapsed, 1), config=cfg.hf_dict())))
        if frac >= 1.0 or (a.max_steps and step >= a.max_steps):
            break
        if a.stop_after and elapsed >= a.stop_after:
            out.mkdir(parents=True, exist_ok=True)
            torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), batcher_rng=batcher.rng.getstate(),
                            torch_rng=torch.get_rng_state(), log=log, step=step, tokens=tokens, elapsed=elapsed),
                       resume_path)
            if bar is not None:
                bar.close()
            print(f"stopped after {elapsed:.0f} s at step {step}; continue with --resume")
            return {}
        _, t, b = next(ph for ph in phases if frac < ph[0])
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, w = batcher.batch(b, t, device)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = fwd(ids[:, :-1]).logits
        nll = token_cross_entropy(logits.float(), ids[:, 1:], reduction="none")
        loss = (nll * w.reshape(-1)).sum() / w.sum()
        gnorm = optimizer_step(opt, loss, clip=model.parameters(), max_norm=1.0)
        step += 1
        tokens += b * t
        if step % 10 == 1 or a.max_steps:
            log.append(dict(step=step, t=round(time.time() - start, 2), seq_len=t, batch=b, lr=lr,
                            loss=float(loss.detach()), grad_norm=float(gnorm), tokens=tokens))
        if bar is not None and int(time.time() - start) > last_tick:
            now = min(int(a.time_budget), int(time.time() - start))
            bar.update(now - last_tick)
            last_tick = now
            bar.set_postfix(step=step, T=t, loss=f"{float(loss.detach()):.3f}", tok_s=f"{tokens / (time.time() - start):.0f}")
    if bar is not None:
        bar.close()
    train_s = time.time() - start
    model.eval()
    val_loss = heldout_loss(model, val, 1024, 16, device, dtype)
    acc = answer_accuracy(model, tasks, lexicon, val, cfg.bos_token_id, a.eval_len, a.eval_n, device, dtype)
    save_checkpoint(model, out, data_dir / "tokenizer.json")
    resume_path.unlink(missing_ok=True)
    result = dict(
        config=cfg.hf_dict(), n_params=n_params, steps=step, tokens_seen=tokens, train_seconds=round(train_s, 1),
        tokens_per_second=round(tokens / max(train_s, 1e-9)), total_seconds=round(time.time() - t0, 1),
        args=vars(a), phases=phases, heldout_loss_1024=round(val_loss, 4), answer_accuracy_teacher_forced={"length": a.eval_len, "n": a.eval_n, **acc},
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        versions=versions(cuda=torch.version.cuda, triton=_version("triton")),
        data_manifest=json.loads((data_dir / "manifest.json").read_text()) if (data_dir / "manifest.json").exists() else None,
        loss_curve=log)
    (out / "train_log.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("loss_curve", "config", "data_manifest")}, indent=1))
    return result


if __name__ == "__main__":
    main()
