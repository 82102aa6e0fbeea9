"""``macattn distill-completion``: train the completion feature maps φ_q / φ_k from a frozen model.

Teacher data (paper App. K): the frozen model runs with full attention on windows of
``seq_len`` tokens; post-RoPE q/k of every layer are captured (``capture_qkv``). The window's
last ``n_queries`` positions are the decode queries, the rest its prefill of ``N`` tokens, and
the support set is the mid region ``M = [n_sink, N - n_tail)``. Teacher logits
``z_t = s·q·k_t``, student logits ``ẑ_t = log Σ_f φ_q(q)_f φ_k(k_t)_f`` (``student_logits``).

Loss for one query (our reading of App. B; its default hyper-parameters are not legible in the
extracted paper text, the values below are ours). Both logit vectors are shifted by the *teacher*
maximum ``z* = max_t z_t`` (so the student's absolute scale, which the unnormalised merge needs,
stays constrained): ``z̃ = z - z*``, ``ẑ̃ = ẑ - z*``.

* ``L_KL = τ² · KL(softmax(z̃/τ) ‖ softmax(ẑ̃/τ))``  (temperature τ, default 2);
* Huber ``H_δ(x) = x²/2`` if ``|x| <= δ`` else ``δ(|x| - δ/2)`` (δ = 1);
* top band ``B = {t : z̃_t >= -Δ_top}`` (Δ_top = 2): ``L_top = mean_{t∈B} H_δ(ẑ̃_t - z̃_t)``;
* far region ``F = {t : z̃_t < -Δ_far}`` (Δ_far = 6): one-sided false positives that reach the
  top band, ``L_far = mean_{t∈F} H_δ(max(ẑ̃_t + Δ_top, 0))`` (0 when F is empty);
* log-partition over-estimation: ``L_Z = H_δ(max(logsumexp ẑ̃ - logsumexp z̃, 0))``;
* ``L = L_KL + λ·(w_top·L_top + w_far·L_far + w_Z·L_Z)`` (λ = w_* = 1), averaged over queries,
  heads and layers.

After training, ``calibrate_mass`` (our addition; ``calibrate_windows = 0`` turns it off) removes
the mean log-partition error per (layer, query head) from φ_q's stem bias, measured on windows
not used for training: the unnormalised merge is only as good as the completion's total mass,
and a short CPU distillation leaves it biased.

Checkpoints: ``<out>/step_<n>/{maps.safetensors, optim.safetensors, meta.json}`` every
``save_every`` steps, ``--resume`` continues from the newest (batches are a function of
``(seed, step)``); the final maps go to ``<out>/feature_maps.{safetensors,json}``
(``load_feature_maps``). Corpus: UTF-8 bytes of ``--corpus`` or the Python stdlib docstrings
(``finetune_mka.stdlib_corpus``); with ``--model-dir`` (the trained tiny LLaMA) its own
tokenizer is used.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import torch

from macattn.apps.configs import DistillConfig, LossConfig
from macattn.apps.trainer_common import (freeze, load_checkpoint, optimizer_step, random_windows,
                                         resume_step, run_fields, save_checkpoint, save_due, step_bar,
                                         step_generator, write_report)
from macattn.models.attention import capture_qkv
from macattn.methods.completion.feature_maps import (CompletionFeatureMaps, FeatureMapSpec, maps_for_model,  # noqa: F401
                                                    save_feature_maps, student_logits)

__all__ = ["DistillConfig", "LossConfig", "distill_loss", "teacher_student_logits", "distill", "calibrate_mass",
           "log_partition_bias", "load_model_and_tokens",
           "maps_for_model", "run_command"]


def _huber(x: torch.Tensor, delta: float) -> torch.Tensor:
    return torch.nn.functional.huber_loss(x, torch.zeros_like(x), reduction="none", delta=delta)


def distill_loss(z: torch.Tensor, zs: torch.Tensor, cfg: LossConfig = LossConfig()) -> tuple[torch.Tensor, dict]:
    """Loss of student logits ``zs`` against teacher logits ``z`` (both ``[..., M]``, unshifted).

    Returns ``(scalar loss, {"kl", "top", "far", "logz": scalar parts})``, means over all rows.
    """
    if z.shape != zs.shape or z.shape[-1] < 1:
        raise ValueError(f"z and zs must have the same shape [..., M >= 1], got {tuple(z.shape)}, {tuple(zs.shape)}")
    zmax = z.amax(-1, keepdim=True)
    zt, st = z - zmax, zs - zmax
    tau = cfg.temperature
    lp_t = torch.log_softmax(zt / tau, -1)
    lp_s = torch.log_softmax(st / tau, -1)
    kl = tau * tau * (lp_t.exp() * (lp_t - lp_s)).sum(-1)
    band = (zt >= -cfg.top_band).float()
    top = (_huber(st - zt, cfg.delta) * band).sum(-1) / band.sum(-1)
    farm = (zt < -cfg.far).float()
    far = (_huber(torch.relu(st + cfg.top_band), cfg.delta) * farm).sum(-1) / farm.sum(-1).clamp_min(1.0)
    logz = _huber(torch.relu(torch.logsumexp(st, -1) - torch.logsumexp(zt, -1)), cfg.delta)
    parts = {"kl": kl.mean(), "top": top.mean(), "far": far.mean(), "logz": logz.mean()}
    loss = parts["kl"] + cfg.aux_weight * (cfg.w_top * parts["top"] + cfg.w_far * parts["far"]
                                           + cfg.w_logz * parts["logz"])
    return loss, parts


def teacher_student_logits(maps: CompletionFeatureMaps, layer: int, q: torch.Tensor, k: torch.Tensor,
                           mid: tuple[int, int], n_queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher and student logits ``[B, Hq, n_queries, |M|]`` of one layer's captured
    ``q [B, Hq, T, d]``, ``k [B, Hkv, T, d]`` for the last ``n_queries`` positions over ``mid``."""
    grp = q.shape[1] // k.shape[1]
    qq = q[:, :, -n_queries:].float()
    km = k[:, :, mid[0]:mid[1]].float()
    z = maps.spec.attn_scale * qq @ km.repeat_interleave(grp, 1).transpose(-1, -2)
    lpq = maps.log_phi_q(layer, qq.transpose(1, 2)).transpose(1, 2)  # [B, Hq, nq, F]
    lpk = maps.log_phi_k(layer, km.transpose(1, 2)).transpose(1, 2)  # [B, Hkv, M, F]
    return z, student_logits(lpq, lpk.repeat_interleave(grp, 1))


def _save(out: Path, step: int, maps: CompletionFeatureMaps, opt: torch.optim.Optimizer, meta: dict) -> Path:
    return save_checkpoint(out, step, maps.state_dict(), "maps.safetensors", list(maps.named_parameters()), opt, meta)


def _load(d: Path, maps: CompletionFeatureMaps, opt: torch.optim.Optimizer) -> int:
    w, step = load_checkpoint(d, "maps.safetensors", list(maps.named_parameters()), opt)
    maps.load_state_dict(w)
    return step


@torch.no_grad()
def log_partition_bias(model, tokens: torch.Tensor, cfg: DistillConfig, maps: CompletionFeatureMaps,
                       steps: list[int]) -> torch.Tensor:
    """Mean over the windows of ``steps`` of ``logsumexp_M ẑ - logsumexp_M z`` per (layer, query head),
    ``[L, Hq]`` fp64: how much the student over-estimates the mid-region mass in log units."""
    acc = torch.zeros(maps.spec.num_layers, maps.spec.num_q_heads, dtype=torch.float64)
    dev = next(model.parameters()).device
    for s in steps:
        for layer, (q, k, _) in enumerate(capture_qkv(model, _windows(tokens, cfg, s).to(dev))):
            z, zs = teacher_student_logits(maps, layer, q, k, cfg.mid, cfg.n_queries)
            acc[layer] += (torch.logsumexp(zs, -1) - torch.logsumexp(z, -1)).double().mean((0, 2)).cpu() / len(steps)
    return acc


@torch.no_grad()
def calibrate_mass(model, tokens: torch.Tensor, cfg: DistillConfig, maps: CompletionFeatureMaps) -> torch.Tensor:
    """Post-training mass calibration: subtract ``log_partition_bias`` (on ``cfg.calibrate_windows``
    windows drawn after the training steps) from φ_q's stem bias per (layer, query head). A constant
    added to ``log φ_q`` shifts every student logit of that head by it, so afterwards the mean
    log-partition error on those windows is 0. Returns the bias removed ``[L, Hq]``."""
    steps = [cfg.steps + 1 + i for i in range(cfg.calibrate_windows)]
    bias = log_partition_bias(model, tokens, cfg, maps, steps)
    for layer, phi in enumerate(maps.phi_q):
        phi.stem_b -= bias[layer].to(phi.stem_b)[:, None]
    return bias.cpu()


def _windows(tokens: torch.Tensor, cfg: DistillConfig, step: int) -> torch.Tensor:
    """The ``[batch, seq_len]`` int64 windows of training step ``step`` (a function of ``(seed, step)``)."""
    return random_windows(tokens, cfg.batch, cfg.seq_len, step_generator(cfg.seed, step))


def distill(model, tokens: torch.Tensor, cfg: DistillConfig, maps: CompletionFeatureMaps, out: str | os.PathLike,
            *, loss_cfg: LossConfig = LossConfig(), resume: bool = False, progress: bool = True) -> dict:
    """Train ``maps`` on teacher logits of the frozen ``model`` over windows of ``tokens [N]``.

    Writes checkpoints and the final maps under ``out``; returns a report dict with the loss
    curve (``losses``) and its parts at the first and last step.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = freeze(model)
    hf = model.config
    if maps.spec.num_layers != hf.num_hidden_layers or maps.spec.num_q_heads != hf.num_attention_heads:
        raise ValueError(f"maps are for {maps.spec.num_layers} layers x {maps.spec.num_q_heads} heads, model has "
                         f"{hf.num_hidden_layers} x {hf.num_attention_heads}")
    opt = torch.optim.AdamW(maps.parameters(), lr=cfg.lr, weight_decay=0.0)
    step = resume_step(out, resume, lambda ck: _load(ck, maps, opt))
    meta = {"distill": asdict(cfg), "loss": asdict(loss_cfg), "maps": asdict(maps.spec)}
    losses, parts_log = [], []
    t0 = time.time()
    bar = step_bar(step, cfg.steps, desc="distill-completion", progress=progress)
    dev = next(model.parameters()).device
    for s in bar:
        qkv = capture_qkv(model, _windows(tokens, cfg, s).to(dev))
        total, acc = 0.0, {}
        for layer, (q, k, _) in enumerate(qkv):
            z, zs = teacher_student_logits(maps, layer, q, k, cfg.mid, cfg.n_queries)
            loss, parts = distill_loss(z, zs, loss_cfg)
            total = total + loss / len(qkv)
            for key, val in parts.items():
                acc[key] = acc.get(key, 0.0) + float(val.detach()) / len(qkv)
        optimizer_step(opt, total)
        losses.append(float(total.detach()))
        parts_log.append(acc)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if save_due(s + 1, cfg):
            _save(out, s + 1, maps, opt, meta)
    calib = calibrate_mass(model, tokens, cfg, maps).tolist() if cfg.calibrate_windows else None
    save_feature_maps(maps, out)
    return {**meta, "losses": losses, "log_partition_bias_removed": calib, "parts_first": parts_log[0] if parts_log else None,
            "parts_last": parts_log[-1] if parts_log else None, "resumed_from_step": step,
            "seconds": time.time() - t0}


def load_model_and_tokens(*, family: str = "llama", model_dir: str | None = None, corpus: str | None = None,
                          seed: int = 0):
    """``(frozen model fp32, token ids [N] int64)``: built-in random-weight model + UTF-8 bytes, or
    the trained checkpoint in ``model_dir`` + its tokenizer. Corpus: ``corpus`` file or stdlib docstrings."""
    from macattn.apps.finetune_mka import stdlib_corpus

    text = Path(corpus).read_text(encoding="utf-8") if corpus else "\n\n".join(stdlib_corpus().values())
    if model_dir:
        from macattn.models.checkpoint import load_builtin_checkpoint

        model, tok = load_builtin_checkpoint(model_dir)
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
    else:
        from macattn.models.builtin import build_builtin_model

        model = build_builtin_model(family, seed=seed)
        ids = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.int64)
    return model.float().eval(), ids


def run_command(args) -> int:
    """``macattn distill-completion`` with its parsed flags (``macattn.cli`` defines them); ``--model builtin``
    is the packaged trained checkpoint (``--model-dir`` its directory)."""
    from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR
    from macattn.models.names import BUILTIN_MODEL

    cfg = DistillConfig(**run_fields(args), n_queries=args.n_queries, n_sink=args.n_sink, n_tail=args.n_tail)
    loss_cfg = LossConfig(temperature=args.temperature)
    torch.manual_seed(args.seed)
    model_dir = args.model_dir or (str(BUILTIN_CHECKPOINT_DIR) if args.model == BUILTIN_MODEL else None)
    model, tokens = load_model_and_tokens(family=args.model, model_dir=model_dir, corpus=args.corpus,
                                          seed=args.seed)
    maps = maps_for_model(model, feature_dim=args.features, hidden=args.hidden, seed=args.seed)
    model, maps = model.to(args.device), maps.to(args.device)
    report = distill(model, tokens, cfg, maps, args.out, loss_cfg=loss_cfg, resume=args.resume,
                     progress=not args.no_progress)
    report["model"] = args.model_dir or (BUILTIN_MODEL if args.model == BUILTIN_MODEL else f"builtin-{args.model}")
    print(json.dumps({"loss_first": report["losses"][0] if report["losses"] else None,
                      "loss_last": report["losses"][-1] if report["losses"] else None,
                      "maps": str(Path(args.out) / "feature_maps.safetensors")}, indent=1))
    write_report(args.json, report)
    return 0
