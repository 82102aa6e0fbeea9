"""``find_host_syncs.sync_sites``: each synchronisation warning counted once by its call site, the warning machinery
given back after (the script's end-to-end run is in ``test_dry_runs.py``; the CUDA sync debug mode itself only
reports on a GPU)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from find_host_syncs import sync_sites  # noqa: E402


def _syncs(n: int) -> None:
    for _ in range(n):
        warnings.warn("called a synchronizing CUDA operation")


def test_each_warning_is_counted_by_its_call_site():
    show = warnings.showwarning
    sites = sync_sites(lambda: (_syncs(3), _syncs(2)))
    assert list(sites.values()) == [5]          # one call site: the same frames every time
    assert warnings.showwarning is show
    assert sync_sites(lambda: None) == {}
