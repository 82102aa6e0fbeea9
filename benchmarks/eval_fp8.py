"""Accuracy of weight-only FP8 (``RuntimeConfig(quantization="fp8")``) against the same model's bf16
weights, through the engine (the whole-step CUDA graph on a GPU).

    python benchmarks/eval_fp8.py                 # GPU: built-in checkpoint + 8B-shaped random model
    python benchmarks/eval_fp8.py --dry-run       # CPU, tiny: checks the script

For each model: the bf16 engine generates ``--steps`` greedy tokens from a prompt; the FP8 engine is
then teacher-forced through the same tokens. Reported per model: the logits' max and mean absolute
difference (and relative to the bf16 logits' mean magnitude) over all steps, and greedy agreement
(the fraction of steps whose FP8 argmax equals the bf16 token). MAC is off (full attention), so
the figures measure the weights alone. JSON under ``benchmarks/results/``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from macattn.methods.mac.config import MacConfig
from macattn.models.attention import unbind
from macattn.runtime.config import RuntimeConfig
from macattn.runtime.engine import LLMEngine, StepOutput

SHAPES_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=8192, tie_word_embeddings=False)


class RecordingEngine(LLMEngine):
    """Records every logits row; with ``script`` appends the scripted tokens instead of its own."""

    def __init__(self, *a, script: list[int] | None = None, **kw):
        super().__init__(*a, **kw)
        self.script, self.rows, self.tokens = script, [], []

    def _append(self, seq, token, logits):
        self.rows.append(logits.float().cpu())
        if self.script is not None:
            token = self.script[len(seq.output)]
        self.tokens.append(token)
        seq.output.append(token)
        done = len(seq.output) >= seq.sampling.max_new_tokens
        if done:
            self.scheduler.finish(seq, "length")
        return StepOutput(seq.request_id, token, done, "length" if done else None)


def run(model, prompt: list[int], steps: int, device: str, quantization, script=None) -> RecordingEngine:
    rc = RuntimeConfig(max_batch_size=1, max_seq_len=len(prompt) + steps + 8, device=device,
                       use_cuda_graphs=device == "cuda", quantization=quantization)
    eng = RecordingEngine(model, MacConfig(enabled=False), rc, script=script)
    eng.add_request(prompt, max_new_tokens=steps)
    eng.run_to_completion()
    unbind(eng.executor.model)
    return eng


def compare(name: str, model, prompt: list[int], steps: int, device: str) -> dict:
    ref = run(model, prompt, steps, device, None)
    fp8 = run(model, prompt, steps, device, "fp8", script=ref.tokens)
    a, b = torch.stack(ref.rows), torch.stack(fp8.rows)
    diff = (b - a).abs()
    agree = (b.argmax(-1) == torch.tensor(ref.tokens)).float()
    scale = float(a.abs().mean())
    return {"model": name, "prompt_tokens": len(prompt), "steps": steps, "logits_max_abs_diff": float(diff.max()),
            "logits_mean_abs_diff": float(diff.mean()), "logits_mean_abs": scale,
            "mean_abs_diff_relative": float(diff.mean()) / scale, "greedy_agreement": float(agree.mean()),
            "first_disagreement": int(torch.nonzero(agree == 0)[0, 0]) if (agree == 0).any() else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="generated tokens (default 256; dry 8)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dry = args.dry_run
    device = "cpu" if dry else "cuda"
    steps = args.steps or (8 if dry else 256)
    from macattn.models.builtin import build_builtin_model
    from macattn.models.checkpoint import builtin_checkpoint_available, heldout_text, load_builtin_checkpoint

    rows = []
    if builtin_checkpoint_available():
        model, tokenizer = load_builtin_checkpoint(dtype=torch.bfloat16 if not dry else torch.float32)
        model = model.to(device)
        prompt = tokenizer.encode(heldout_text()[:6000])[:(64 if dry else 1024)]
        rows.append(compare("builtin checkpoint (trained)", model, prompt, steps, device))
    else:
        model = build_builtin_model("llama", seed=0).to(device)
        rows.append(compare("builtin llama (random weights; checkpoint not found)", model,
                            list(range(1, 65)), steps, device))
    print(json.dumps(rows[-1]), flush=True)
    del model
    if not dry:
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.cuda.empty_cache()
        with torch.device("cuda"):
            big = AutoModelForCausalLM.from_config(LlamaConfig(**SHAPES_8B), dtype=torch.bfloat16,
                                                   attn_implementation="sdpa").eval()
        g = torch.Generator().manual_seed(0)
        rows.append(compare("LLaMA-3.1-8B shapes (random weights)", big,
                            torch.randint(0, SHAPES_8B["vocab_size"], (256,), generator=g).tolist(), steps, device))
        print(json.dumps(rows[-1]), flush=True)
    report = {"benchmark": "eval_fp8", "device": torch.cuda.get_device_name() if not dry else platform.machine(),
              "torch": torch.__version__, "rows": rows}
    print(f"\n{'model':<48} {'max |d|':>9} {'mean |d|':>9} {'rel':>8} {'greedy agree':>12}")
    for r in rows:
        print(f"{r['model']:<48} {r['logits_max_abs_diff']:>9.4f} {r['logits_mean_abs_diff']:>9.4f} "
              f"{r['mean_abs_diff_relative']:>8.4f} {r['greedy_agreement']:>12.3f}")
    out = args.out or (None if dry else Path(__file__).parent / "results" /
                       f"eval_fp8_{report['device'].split()[1].lower()}.json")
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
