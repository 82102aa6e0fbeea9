"""TensorRT compatibility facts, one source for the plugins, ONNX export, builders and runtime:
the names the plugins register under and the TensorRT versions each path needs (``require_version``).

Names.

Two implementations of ``match`` / ``attend`` exist and may be loaded into one process:

* the native ``IPluginV3`` library ``libmacattn_trt.so`` registers namespace ``NATIVE_NAMESPACE``
  (``kPluginNamespace`` in ``plugins/trt_plugin_common.h``; a test checks they agree);
* the Python plugins (``tensorrt.plugin``: descriptor + JIT + AOT impls) register namespace
  ``PYTHON_NAMESPACE``.

TensorRT's registry refuses a second creator with the same name, version and namespace
(``IPluginRegistry::registerCreator`` returns false; ``load_library`` fails when any of its
plugins is already registered), so the two must differ. Plugin version is ``"1"`` everywhere
(``tensorrt.plugin`` registers every creator as version ``"1"``).
"""
from __future__ import annotations

import os
import re

__all__ = ["NATIVE_NAMESPACE", "PYTHON_NAMESPACE", "PLUGIN_VERSION", "python_id", "native_id", "split_id",
           "MIN_PYTHON_PLUGINS", "MIN_ALIASED_IO", "MIN_TENSORRT", "TensorRTVersionError", "parse_version",
           "require_version", "load_plugin_library"]

NATIVE_NAMESPACE = "mac"
PYTHON_NAMESPACE = "mac_py"
PLUGIN_VERSION = "1"


def python_id(name: str) -> str:
    """``"<PYTHON_NAMESPACE>::<name>"``: the ``tensorrt.plugin`` id of a Python plugin."""
    return f"{PYTHON_NAMESPACE}::{name}"


def native_id(name: str) -> str:
    """``"<NATIVE_NAMESPACE>::<name>"``: a creator of ``libmacattn_trt.so``."""
    return f"{NATIVE_NAMESPACE}::{name}"


def split_id(plugin_id: str) -> tuple[str, str]:
    """``(namespace, name)`` of ``"namespace::name"``; ``ValueError`` naming ``plugin_id`` otherwise."""
    ns, sep, name = plugin_id.partition("::")
    if not sep or not ns or not name or "::" in name:
        raise ValueError(f"plugin_id must be 'namespace::name', got {plugin_id!r}")
    return ns, name


# ---------------------------------------------------------------- versions
# ``tensorrt.plugin``'s ``aot_impl`` / ``KernelLaunchParams`` / ``QuickPluginCreationRequest`` first ship in 10.9
# (10.8 has ``register`` / ``impl`` only): the Python plugins define an AOT impl, so they need 10.9.
MIN_PYTHON_PLUGINS = (10, 9)
# aliased plugin I/O (the rings, updated in place): ``IPluginV3OneBuildV2::getAliasedInput`` and the builder
# preview feature ``PreviewFeature.ALIASED_PLUGIN_IO_10_03`` first ship in 10.3.
MIN_ALIASED_IO = (10, 3)
# the engine build and the ``.plan`` runner: ``IPluginV3`` networks with aliased rings.
MIN_TENSORRT = MIN_ALIASED_IO


class TensorRTVersionError(ImportError):
    """An installed TensorRT (or TensorRT-LLM) older than a path needs. An ``ImportError``, so callers that
    treat "no usable TensorRT" alike keep working."""


def parse_version(version: str) -> tuple[int, ...]:
    """``"10.9.0.34"`` -> ``(10, 9, 0, 34)`` (leading numeric parts; ``ValueError`` naming ``version``
    when there are none)."""
    parts = []
    for p in str(version).split("."):
        m = re.match(r"\d+", p)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(p):
            break
    if not parts:
        raise ValueError(f"version must start with a number, got {version!r}")
    return tuple(parts)


def require_version(package: str, found: str, minimum: tuple[int, ...], what: str) -> tuple[int, ...]:
    """``parse_version(found)`` if it is ``>= minimum``, else ``TensorRTVersionError`` naming the package,
    the version found, the minimum and ``what`` needs it."""
    have = parse_version(found)
    if have[:len(minimum)] < tuple(minimum):
        need = ".".join(map(str, minimum))
        raise TensorRTVersionError(f"{what} needs {package} >= {need}; found {package} {found}")
    return have


# ---------------------------------------------------------------- plugin libraries
# TensorRT's plugin registry is one per process (``get_plugin_registry()`` of a Builder, a Runtime and the module
# return the same registry), and ``load_library`` of a library already loaded fails (its creators are registered)
_LOADED_LIBRARIES: dict[str, object] = {}


def load_plugin_library(registry, path) -> object:
    """Load the plugin library at ``path`` into TensorRT's process-wide ``registry`` once per process; returns the
    handle of the first load. ``RuntimeError`` naming ``path`` when TensorRT refuses it (``load_library`` returned
    None: a creator of the same name / version / namespace is already registered, or the file does not load)."""
    key = os.path.realpath(os.fspath(path))
    if key not in _LOADED_LIBRARIES:
        handle = registry.load_library(key)
        if handle is None:
            raise RuntimeError(f"TensorRT refused to load the plugin library {path} (a creator of the same "
                               f"name/version/namespace is already registered, or the library does not load)")
        _LOADED_LIBRARIES[key] = handle
    return _LOADED_LIBRARIES[key]
