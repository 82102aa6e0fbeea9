"""``macattn triton-repo``: the repository layout, config.pbtxt contents and parameter round trip."""
import json

import pytest
from _tiny import MAC, tiny_model

from macattn.cli import main
from macattn.methods.mac.config import MacConfig
from macattn.runtime import write_engine_dir
from macattn.apps.serving.triton_repo import write_model_repository


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return write_engine_dir(tiny_model(), MAC, tmp_path_factory.mktemp("eng") / "engine")


def _model_py_parameter_reader(model_py):
    """Run model.py's import-time part (everything before its first ``_add_site_dirs(...)`` call)
    to get its ``_config_parameter`` without the Triton runtime."""
    text = model_py.read_text()
    head = text[:text.index("\n_add_site_dirs(json.loads(")]
    ns = {"__file__": str(model_py), "__name__": "model_under_test"}
    exec(compile(head, str(model_py), "exec"), ns)     # noqa: S102 - our own file
    return ns["_config_parameter"]


def test_cli_writes_decoupled_and_sync_models(engine, tmp_path, capsys):
    assert main(["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "repo"), "--max-batch-size", "4",
                 "--torch-threads", "1"]) == 0
    assert "wrote" in capsys.readouterr().out
    stream = (tmp_path / "repo" / "macattn" / "config.pbtxt").read_text()
    sync = (tmp_path / "repo" / "macattn_sync" / "config.pbtxt").read_text()
    assert "model_transaction_policy { decoupled: true }" in stream and "decoupled" not in sync
    for text in (stream, sync):
        assert 'backend: "python"' in text
        assert 'name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] }' in text
        assert 'name: "max_new_tokens" data_type: TYPE_INT32 dims: [ 1 ] }' in text
        assert 'name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true' in text
        assert 'name: "output_ids" data_type: TYPE_INT64 dims: [ -1 ]' in text
        assert 'key: "mac_window" value: { string_value: "16" }' in text
    assert (tmp_path / "repo" / "macattn" / "1" / "model.py").is_file()


def test_parameters_round_trip_through_pbtxt(engine, tmp_path):
    odd = [str(tmp_path / 'we"ird\\dir'), str(tmp_path / "ünïcode")]
    mac = MacConfig(window=8, band=2, tau=0.3).with_overrides({1: {"enabled": False}})
    write_model_repository(engine, tmp_path / "repo", mac_config=mac, sys_path=odd, sync_model=False)
    assert not (tmp_path / "repo" / "macattn_sync").exists()
    read = _model_py_parameter_reader(tmp_path / "repo" / "macattn" / "1" / "model.py")
    assert json.loads(read("sys_path")) == odd
    assert MacConfig.from_dict(json.loads(read("mac_config"))) == mac
    assert read("engine_dir") == str(engine.resolve())
    assert read("missing") is None


def test_bad_arguments_are_named(engine, tmp_path):
    with pytest.raises(ValueError, match="max_batch_size"):
        write_model_repository(engine, tmp_path / "r", max_batch_size=0)
    with pytest.raises(ValueError, match="name"):
        write_model_repository(engine, tmp_path / "r", name="a b")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        write_model_repository(tmp_path, tmp_path / "r")


def test_completion_offload_options_round_trip_and_build_the_method(engine, tmp_path):
    """``triton-repo --completion --kv-offload host --prefix-store DIR`` writes the ``completion`` parameter and
    the ``reuse_prefix`` input; the options parsed back build the offloaded engine method (what model.py does)."""
    from macattn.runtime.completion_setup import completion_method, completion_options_from_json

    store = tmp_path / "prefixes"
    assert main(["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "repo"), "--completion",
                 "--kv-offload", "host", "--prefix-store", str(store), "--no-sync-model"]) == 0
    text = (tmp_path / "repo" / "macattn" / "config.pbtxt").read_text()
    assert 'name: "reuse_prefix" data_type: TYPE_BOOL dims: [ 1 ] optional: true' in text
    read = _model_py_parameter_reader(tmp_path / "repo" / "macattn" / "1" / "model.py")
    opts = completion_options_from_json(read("completion"))
    assert opts["kv_offload"] == "host" and opts["prefix_store"] == str(store)
    name, cfg, kwargs = completion_method(tiny_model(), "completion", **opts)
    assert name == "completion_offload" and cfg.selector == "quest" and kwargs["store"] is not None
    with pytest.raises(ValueError, match="kv_offload"):
        write_model_repository(engine, tmp_path / "r2", completion='{"kv_offload": "disk"}')
    with pytest.raises(SystemExit):          # argparse's error: the message names the flags
        main(["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "r3"), "--kv-offload", "host"])
    assert not (tmp_path / "r3").exists()
