"""The main job (`macattn generate`) on the trained checkpoint and on a random-weight family."""
import json

import pytest

from macattn.models.checkpoint import builtin_checkpoint_available
from macattn.cli import main
from macattn.models.names import BUILTIN_MODEL


@pytest.mark.skipif(not builtin_checkpoint_available(), reason="the packaged checkpoint is absent")
def test_main_job_on_trained_checkpoint(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["generate", "--context", "768", "--tokens", "6", "--window", "128", "--band", "32",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["model"].startswith(f"{BUILTIN_MODEL}, the trained checkpoint") and r["needle"]["retrieved"] is True
    assert r["new_tokens"] == 6 and 0.0 <= r["hit_rate"] <= 1.0 and 0.0 <= r["greedy_agreement"] <= 1.0
    assert len(r["hit_rate_per_layer"]) == 8
    assert "needle answer expected" in capsys.readouterr().out


def test_main_job_random_family_and_bad_input(tmp_path):
    out = tmp_path / "r.json"
    assert main(["generate", "--model", "qwen2", "--context", "300", "--tokens", "3", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["needle"] is None and r["context"] == 300
    with pytest.raises(SystemExit):
        main(["generate", "--tokens", "1"])
