"""``macattn triton-repo``: the repository layout, config.pbtxt contents and the one ``engine_args`` parameter's
round trip (``EngineArgs``)."""
import json

import pytest
from _tiny import MAC, tiny_model

from macattn.cli import main
from macattn.methods.mac.config import MacConfig
from macattn.runtime import write_engine_dir
from macattn.runtime.engine_args import EngineArgs
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
        assert 'name: "max_new_tokens" data_type: TYPE_INT64 dims: [ 1 ] }' in text
        assert 'name: "end_id" data_type: TYPE_INT64 dims: [ 1 ] optional: true' in text
        assert 'name: "output_ids" data_type: TYPE_INT64 dims: [ -1 ]' in text
        assert 'key: "mac_window"' not in text and 'key: "engine_args"' in text
    assert (tmp_path / "repo" / "macattn" / "1" / "model.py").is_file()
    args = EngineArgs.from_json(_model_py_parameter_reader(tmp_path / "repo" / "macattn" / "1" / "model.py")(
        "engine_args"))
    assert args.max_batch_size == 4 and args.mac_config() == MAC          # the engine dir's MAC config
    assert args.model == str((engine / "hf").resolve())


def test_parameters_round_trip_through_pbtxt(engine, tmp_path):
    odd = [str(tmp_path / 'we"ird\\dir'), str(tmp_path / "ünïcode")]
    mac = MacConfig(window=8, band=2, tau=0.3).with_overrides({1: {"enabled": False}})
    write_model_repository(engine, tmp_path / "repo", engine_args=EngineArgs(mac=mac.to_dict(), mac_tau=0.4),
                           sys_path=odd, sync_model=False)
    assert not (tmp_path / "repo" / "macattn_sync").exists()
    read = _model_py_parameter_reader(tmp_path / "repo" / "macattn" / "1" / "model.py")
    assert json.loads(read("sys_path")) == odd
    args = EngineArgs.from_json(read("engine_args"))
    assert args.mac_config() == MacConfig(window=8, band=2, tau=0.4).with_overrides({1: {"enabled": False}})
    assert read("missing") is None


def test_bad_arguments_are_named(engine, tmp_path):
    with pytest.raises(ValueError, match="max_batch_size"):
        write_model_repository(engine, tmp_path / "r", engine_args=EngineArgs(max_batch_size=0))
    with pytest.raises(TypeError, match="engine_args"):
        write_model_repository(engine, tmp_path / "r", engine_args={"max_batch_size": 2})
    with pytest.raises(ValueError, match="name"):
        write_model_repository(engine, tmp_path / "r", name="a b")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        write_model_repository(tmp_path, tmp_path / "r")


def test_completion_offload_options_round_trip_and_build_the_method(engine, tmp_path):
    """``triton-repo --completion --kv-offload host --prefix-store DIR`` writes them into ``engine_args`` and the
    ``reuse_prefix`` input; the args read back build the offloaded engine method (what model.py does)."""
    store = tmp_path / "prefixes"
    assert main(["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "repo"), "--completion",
                 "--kv-offload", "host", "--prefix-store", str(store), "--no-sync-model", "--max-seq-len", "128",
                 "--max-batch-size", "2"]) == 0
    text = (tmp_path / "repo" / "macattn" / "config.pbtxt").read_text()
    assert 'name: "reuse_prefix" data_type: TYPE_BOOL dims: [ 1 ] optional: true' in text
    read = _model_py_parameter_reader(tmp_path / "repo" / "macattn" / "1" / "model.py")
    args = EngineArgs.from_json(read("engine_args"))
    assert args.method == "completion" and args.kv_offload == "host" and args.prefix_store == str(store)
    eng = args.build_engine()
    assert eng.method.name == "completion_offload" and eng.method.config.selector == "quest"
    with pytest.raises(ValueError, match="kv_offload"):
        EngineArgs(method="completion", kv_offload="disk")
    with pytest.raises(SystemExit):          # argparse's error: the message names the flags
        main(["triton-repo", "--engine", str(engine), "--out", str(tmp_path / "r3"), "--kv-offload", "host"])
    assert not (tmp_path / "r3").exists()
