"""The training model (training/train_tiny_llama.py) saves a checkpoint that transformers loads
with identical logits, and the built-in checkpoint loader behaves when weights are absent."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)


def _train_module():
    spec = importlib.util.spec_from_file_location("train_tiny_llama", ROOT / "training/train_tiny_llama.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_tiny_llama"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("tied,kv_heads", [(True, 2), (False, 1)])
def test_saved_checkpoint_reloads_with_identical_logits(tmp_path, tied, kv_heads):
    from transformers import LlamaForCausalLM

    T = _train_module()
    torch.manual_seed(0)
    cfg = T.ModelConfig(**{**TINY, "num_key_value_heads": kv_heads, "tie_word_embeddings": tied})
    model = T.build_model(cfg).eval()
    with torch.no_grad():  # bf16-exact weights and non-trivial norms, so the bf16 save is lossless
        for p in model.parameters():
            p.copy_((p.uniform_(0.5, 1.5) if p.dim() == 1 else p).to(torch.bfloat16).float())
    ids = torch.randint(0, cfg.vocab_size, (2, 37))
    with torch.no_grad():
        ref = model(ids).logits
    T.save_checkpoint(model, tmp_path, None)
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        got = hf(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tied


def _tiny_data(tmp_path: Path, tasks) -> Path:
    """A toy data dir: byte-valued ids and a lexicon mapping every task fragment to bytes % 93 + 3."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(3, 96, 5000).astype(np.uint16))
    np.save(tmp_path / "val.npy", rng.integers(3, 96, 2000).astype(np.uint16))
    lex = {f: [b % 93 + 3 for b in f.encode()] for f in tasks.all_fragments()}
    (tmp_path / "lexicon.json").write_text(json.dumps(lex))
    return tmp_path


def test_training_script_runs_end_to_end_and_loads(tmp_path):
    from macattn.models.checkpoint import load_builtin_checkpoint
    from macattn.evaluation import tasks

    T = _train_module()
    (tmp_path / "data").mkdir()
    data = _tiny_data(tmp_path / "data", tasks)
    out = tmp_path / "ckpt"
    res = T.main(["--data", str(data), "--out", str(out), "--max-steps", "4", "--time-budget", "600",
                  "--phases", "0.5:400x2,1:500x2", "--eval-len", "400", "--eval-n", "1", "--device", "cpu",
                  "--model", json.dumps(TINY)])
    log = json.loads((out / "train_log.json").read_text())
    assert res["steps"] == log["steps"] == 4
    assert log["tokens_seen"] == 4 * 2 * 400
    assert all(math.isfinite(r["loss"]) for r in log["loss_curve"])
    assert set(log["answer_accuracy_teacher_forced"]) >= set(tasks.TASKS)
    # no tokenizer.json in the toy data: the loader must refuse, naming what is missing
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_builtin_checkpoint(out)


def test_training_stops_resumes_and_snapshots(tmp_path):
    """--stop-after saves resume state and no checkpoint; --resume continues the step count, writes the
    snapshots still due and the final checkpoint, and removes the resume state."""
    from macattn.evaluation import tasks

    T = _train_module()
    (tmp_path / "data").mkdir()
    data = _tiny_data(tmp_path / "data", tasks)
    out = tmp_path / "ckpt"
    args = ["--data", str(data), "--out", str(out), "--time-budget", "4", "--phases", "1:400x2", "--eval-len", "400",
            "--eval-n", "1", "--device", "cpu", "--model", json.dumps(TINY), "--snapshots", "0.05,0.9"]
    with pytest.raises(FileNotFoundError, match="--resume"):
        T.main(args + ["--resume"])
    assert T.main(args + ["--stop-after", "1"]) == {}
    state = torch.load(out / "resume.pt", weights_only=False)
    assert state["step"] > 0 and 1.0 <= state["elapsed"] < 4.0
    assert not (out / "config.json").exists()
    assert [p.name for p in (out / "snapshots").iterdir()] == ["f005"]
    res = T.main(args + ["--resume"])
    assert res["steps"] > state["step"] and res["loss_curve"][0]["step"] == 1
    assert sorted(p.name for p in (out / "snapshots").iterdir()) == ["f005", "f090"]
    assert json.loads((out / "snapshots" / "f090" / "train_log.json").read_text())["step"] > state["step"]
    assert (out / "config.json").exists() and not (out / "resume.pt").exists()
    with pytest.raises(ValueError, match="--snapshots"):
        T.main(args + ["--snapshots", "1.5"])


def test_loader_error_says_how_to_train(tmp_path):
    from macattn.models.checkpoint import load_builtin_checkpoint

    with pytest.raises(FileNotFoundError, match="train_tiny_llama.py"):
        load_builtin_checkpoint(tmp_path)
    with pytest.raises(TypeError, match="dtype"):
        load_builtin_checkpoint(tmp_path, dtype=torch.int32)


def test_phases_are_validated():
    T = _train_module()
    assert T.parse_phases("0.5:128x4,1:256x2") == [(0.5, 128, 4), (1.0, 256, 2)]
    with pytest.raises(ValueError, match="--phases"):
        T.parse_phases("0.5:128x4,0.9:256x2")


def test_token_shards_must_be_uint16(tmp_path):
    T = _train_module()
    arr = np.array([0, 1, 65535, 40000, 7], dtype=np.uint16)
    np.save(tmp_path / "a.npy", arr)
    assert T.load_tokens(tmp_path / "a.npy").tolist() == arr.astype(np.int64).tolist()
    np.save(tmp_path / "b.npy", arr.astype(np.int32))
    with pytest.raises(ValueError, match="uint16"):
        T.load_tokens(tmp_path / "b.npy")


def test_packaged_checkpoint_is_small_and_loads():
    from macattn.models.checkpoint import BUILTIN_CHECKPOINT_DIR, builtin_checkpoint_available, heldout_text

    if not builtin_checkpoint_available():
        pytest.skip("the packaged checkpoint is absent")
    shards = sorted(BUILTIN_CHECKPOINT_DIR.glob("*.safetensors"))
    assert shards and sum(p.stat().st_size for p in shards) <= 40e6
    log = json.loads((BUILTIN_CHECKPOINT_DIR / "train_log.json").read_text())
    assert log["answer_accuracy_teacher_forced"]["niah_single"] >= 0.9  # it learned to retrieve
    assert len(heldout_text()) > 100_000
