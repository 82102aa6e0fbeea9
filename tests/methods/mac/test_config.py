"""MacConfig / LayerMacParams: validation, per-layer resolution, (de)serialisation."""
import dataclasses
import json
import math

import pytest

from macattn.methods.mac.config import (CONTEXT_HEAVY_TAU, GENERATION_HEAVY_TAU, LayerMacParams, MacConfig)


def test_defaults_are_the_paper_defaults():
    cfg = MacConfig()
    assert (cfg.window, cfg.band, cfg.tau, cfg.enabled) == (1024, 256, CONTEXT_HEAVY_TAU, True)
    assert cfg.layer_overrides == ()
    assert (CONTEXT_HEAVY_TAU, GENERATION_HEAVY_TAU) == (0.45, 0.75)
    assert cfg.for_layer(0) == LayerMacParams()


# (field, bad value, expected exception)
BAD_FIELD_VALUES = [
    ("window", "8", TypeError), ("window", 8.0, TypeError), ("window", True, TypeError),
    ("window", None, TypeError), ("window", 0, ValueError), ("window", -3, ValueError),
    ("band", "1", TypeError), ("band", 1.5, TypeError), ("band", False, TypeError),
    ("band", -1, ValueError),
    ("tau", "0.5", TypeError), ("tau", None, TypeError), ("tau", True, TypeError),
    ("tau", 1.0, ValueError), ("tau", 1, ValueError), ("tau", -0.01, ValueError),
    ("tau", float("nan"), ValueError), ("tau", float("inf"), ValueError),
    ("enabled", 1, TypeError), ("enabled", "yes", TypeError), ("enabled", None, TypeError),
]


@pytest.mark.parametrize("cls", [MacConfig, LayerMacParams])
@pytest.mark.parametrize("name,value,exc", BAD_FIELD_VALUES)
def test_global_field_rejects_bad_value(cls, name, value, exc):
    with pytest.raises(exc, match=rf"^{name}\b"):
        cls(**{name: value})


@pytest.mark.parametrize("name,value,exc", BAD_FIELD_VALUES)
def test_override_field_rejects_bad_value(name, value, exc):
    with pytest.raises(exc, match=rf"^layer_overrides\[3\]: {name}\b"):
        MacConfig(window=64, band=8, layer_overrides={3: {name: value}})


@pytest.mark.parametrize("name,value", [("window", 1), ("band", 0), ("tau", 0.0), ("tau", 0.999999),
                                        ("enabled", False)])
def test_boundary_values_are_accepted(name, value):
    assert getattr(MacConfig(**{name: value}), name) == value
    assert getattr(MacConfig(layer_overrides={0: {name: value}}).for_layer(0), name) == value


def test_tau_int_is_normalised_to_float():
    cfg = MacConfig(tau=0)
    assert cfg.tau == 0.0 and isinstance(cfg.tau, float)


@pytest.mark.parametrize("overrides,exc,pattern", [
    (5, TypeError, r"layer_overrides must be a mapping"),
    ("0:window=4", TypeError, r"layer_overrides must be a mapping"),
    (((0, {"window": 4}, "x"),), TypeError, r"layer_overrides entries must be \(layer, fields\) pairs"),
    ((7,), TypeError, r"layer_overrides entries must be \(layer, fields\) pairs"),
    ({-1: {"window": 4}}, ValueError, r"layer_overrides layer index"),
    ({1.0: {"window": 4}}, TypeError, r"layer_overrides layer index"),
    ({True: {"window": 4}}, TypeError, r"layer_overrides layer index"),
    ({"x": {"window": 4}}, TypeError, r"layer_overrides layer index"),
    ({0: {"windw": 4}}, ValueError, r"layer_overrides\[0\] has unknown fields \['windw'\]"),
    ({0: {"layer_overrides": {}}}, ValueError, r"layer_overrides\[0\] has unknown fields"),
    ({1: {"window": 4}, "1": {"band": 2}}, ValueError, r"layer_overrides names a layer twice"),
    (((2, {"window": 4}), (2, {"band": 1})), ValueError, r"layer_overrides names a layer twice"),
    ({0: 5}, TypeError, r"layer_overrides\[0\]"),
])
def test_layer_overrides_structure_is_validated(overrides, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MacConfig(layer_overrides=overrides)


def test_override_validated_against_resolved_values():
    # band 0 globally is fine; an override window must still be >= 1, and each resolved layer
    # is a valid LayerMacParams
    cfg = MacConfig(band=0, layer_overrides={2: {"band": 5}})
    assert cfg.for_layer(2).band == 5 and cfg.for_layer(1).band == 0


def test_for_layer_resolves_overrides():
    cfg = MacConfig(window=64, band=8, tau=0.5,
                    layer_overrides={0: {"window": 16}, 3: {"band": 2, "tau": 0.75, "enabled": False},
                                     "5": {"tau": 0.1}})
    assert cfg.for_layer(0) == LayerMacParams(window=16, band=8, tau=0.5, enabled=True)
    assert cfg.for_layer(1) == LayerMacParams(window=64, band=8, tau=0.5, enabled=True)
    assert cfg.for_layer(3) == LayerMacParams(window=64, band=2, tau=0.75, enabled=False)
    assert cfg.for_layer(5) == LayerMacParams(window=64, band=8, tau=0.1, enabled=True)
    assert cfg.for_layer(1000) == cfg.for_layer(1)
    assert isinstance(cfg.for_layer(0), LayerMacParams) and not isinstance(cfg.for_layer(0), MacConfig)
    # normalised: sorted by layer, int keys, sorted field pairs
    assert [i for i, _ in cfg.layer_overrides] == [0, 3, 5]
    assert cfg.layer_overrides[1] == (3, (("band", 2), ("enabled", False), ("tau", 0.75)))
    # mapping and tuple forms are the same config
    assert MacConfig(window=64, band=8, tau=0.5, layer_overrides=cfg.layer_overrides) == cfg
    assert hash(MacConfig(window=64, band=8, tau=0.5, layer_overrides=cfg.layer_overrides)) == hash(cfg)


@pytest.mark.parametrize("layer,exc", [(-1, ValueError), ("1", TypeError), (1.0, TypeError), (True, TypeError)])
def test_for_layer_rejects_bad_layer(layer, exc):
    with pytest.raises(exc, match=r"^layer\b"):
        MacConfig().for_layer(layer)


def test_with_overrides_merges_and_validates():
    cfg = MacConfig(window=64, layer_overrides={1: {"window": 8}})
    new = cfg.with_overrides({1: {"band": 4}, 2: {"tau": 0.9}})
    assert new.for_layer(1) == LayerMacParams(window=8, band=4, tau=cfg.tau)
    assert new.for_layer(2).tau == 0.9
    assert cfg.for_layer(1).band == 256          # original untouched
    with pytest.raises(ValueError, match=r"layer_overrides\[2\]: window"):
        cfg.with_overrides({2: {"window": 0}})


def test_threshold():
    p = LayerMacParams(tau=0.75)
    assert p.threshold(128) == pytest.approx(math.sqrt(256) * 0.25)
    assert LayerMacParams(tau=0.0).threshold(2) == pytest.approx(2.0)


def test_dict_round_trip():
    cfg = MacConfig(window=512, band=64, tau=0.75, enabled=False,
                    layer_overrides={2: {"window": 128, "enabled": True}, 0: {"tau": 0.3}})
    d = cfg.to_dict()
    assert d == {"window": 512, "band": 64, "tau": 0.75, "enabled": False,
                 "layer_overrides": {"0": {"tau": 0.3}, "2": {"enabled": True, "window": 128}}}
    json.dumps(d)  # JSON-serialisable
    back = MacConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg
    assert back.for_layer(2) == cfg.for_layer(2)
    assert MacConfig.from_dict(MacConfig().to_dict()) == MacConfig()


def test_from_dict_rejects_unknown_and_bad_fields():
    with pytest.raises(ValueError, match=r"unknown MacConfig fields \['windw'\]"):
        MacConfig.from_dict({"windw": 3})
    with pytest.raises(ValueError, match=r"^band\b"):
        MacConfig.from_dict({"band": -2})


def test_save_load_round_trip(tmp_path):
    cfg = MacConfig(window=256, band=32, tau=0.6, layer_overrides={1: {"band": 16}, 4: {"enabled": False}})
    path = tmp_path / "mac.json"
    cfg.save(path)
    assert json.loads(path.read_text())["layer_overrides"] == {"1": {"band": 16}, "4": {"enabled": False}}
    loaded = MacConfig.load(str(path))
    assert loaded == cfg and loaded.for_layer(4).enabled is False and loaded.for_layer(1).band == 16


def test_save_load_rejects_tampered_file(tmp_path):
    path = tmp_path / "mac.json"
    MacConfig().save(path)
    d = json.loads(path.read_text())
    d["layer_overrides"] = {"0": {"tau": 1.5}}
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"layer_overrides\[0\]: tau"):
        MacConfig.load(path)


@pytest.mark.parametrize("name", ["window", "band", "tau", "enabled", "layer_overrides"])
def test_config_is_frozen(name):
    cfg = MacConfig(layer_overrides={0: {"window": 4}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, name, getattr(cfg, name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.for_layer(0).window = 3
    hash(cfg)


def test_any_mapping_type_is_accepted_for_overrides():
    import types
    from collections.abc import Mapping

    class Frozen(Mapping):
        def __init__(self, d):
            self._d = dict(d)

        def __getitem__(self, k):
            return self._d[k]

        def __iter__(self):
            return iter(self._d)

        def __len__(self):
            return len(self._d)

    ref = MacConfig(layer_overrides={1: {"window": 8}})
    assert MacConfig(layer_overrides=Frozen({1: Frozen({"window": 8})})) == ref
    assert MacConfig(layer_overrides=types.MappingProxyType({1: {"window": 8}})) == ref
    assert MacConfig(layer_overrides=[(1, [("window", 8)])]) == ref


def test_completion_miss_policy_is_rejected_where_not_implemented():
    from macattn.runtime import ModelRunner
    from macattn.models.builtin import build_builtin_model

    cfg = MacConfig(window=8, band=2).with_overrides({1: {"miss_policy": "completion"}})
    assert MacConfig.from_dict(cfg.to_dict()) == cfg
    MacConfig().require_engine_support("x")
    with pytest.raises(ValueError, match=r"miss_policy='completion'.*ModelRunner.*\[1\]"):
        ModelRunner.from_hf(build_builtin_model("llama"), cfg)


@pytest.mark.parametrize("value,exc,pattern", [
    ("1.0", TypeError, r"^match_scale must be a float > 0 or a list"),
    ([1.0, 0.0], ValueError, r"^match_scale\[1\] must be a float > 0, got 0.0"),
    ([1.0, float("nan")], ValueError, r"^match_scale\[1\] must be a float > 0"),
    ([True], TypeError, r"^match_scale\[0\] must be a float > 0"),
])
def test_match_scale_rejects_bad_values(value, exc, pattern):
    with pytest.raises(exc, match=pattern):
        MacConfig(match_scale=value)
    with pytest.raises(exc, match=r"^layer_overrides\[2\]: " + pattern[1:]):
        MacConfig(layer_overrides={2: {"match_scale": value}})


def test_match_scale_defaults_to_the_paper_rule_and_round_trips(tmp_path):
    import random

    rng = random.Random(11)
    assert MacConfig().match_scale == () and "match_scale" not in MacConfig().to_dict()
    assert MacConfig().match_scales(4) is None and MacConfig(tau=0.3).threshold(64) == math.sqrt(128) * 0.7
    scales = [[rng.uniform(0.2, 3.0) for _ in range(4)], [rng.uniform(0.2, 3.0)]]
    cfg = MacConfig(tau=0.3).with_match_scales(scales)
    assert cfg.for_layer(0).match_scales(4) == tuple(scales[0])
    assert cfg.for_layer(1).match_scales(4) == (scales[1][0],) * 4 and cfg.for_layer(2).match_scales(4) is None
    assert cfg.for_layer(0).threshold(64, head=2) == pytest.approx(scales[0][2] * math.sqrt(128) * 0.7)
    hash(cfg)
    cfg.save(tmp_path / "c.json")
    assert MacConfig.load(tmp_path / "c.json") == cfg
    assert json.loads((tmp_path / "c.json").read_text())["layer_overrides"]["0"]["match_scale"] == scales[0]
    with pytest.raises(ValueError, match="match_scale must hold 1 or num_q_heads=3 values, got 4"):
        cfg.for_layer(0).match_scales(3)
