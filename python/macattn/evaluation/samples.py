"""The evaluation's sample set: ``EvalSettings`` (lengths, tasks, samples per cell, decode steps, seed)
with the ``PRESETS`` of ``macattn eval``, and ``make_samples``, the deterministic list of ``tasks.Sample`` both the harness (``run_eval``) and the
long-generation benchmark (``long_gen``) run on. Pure standard library, as ``tasks``."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from macattn.evaluation import tasks as T

__all__ = ["EvalSettings", "PRESETS", "make_samples"]


@dataclass(frozen=True)
class EvalSettings:
    """lengths: prompt+answer lengths in tokens (>= 64); tasks: subset of ``tasks.TASKS``; n: samples
    per task and length (>= 1); gen: teacher-forced decode steps for agreement and error (>= 2);
    seed: sample seed."""

    lengths: tuple = (4096,)
    tasks: tuple = T.TASKS
    n: int = 2
    gen: int = 32
    seed: int = 0

    def __post_init__(self):
        T.check_lengths_and_tasks(self.lengths, self.tasks)
        if self.n < 1 or self.gen < 2:
            raise ValueError(f"n must be >= 1 and gen >= 2, got n={self.n}, gen={self.gen}")


PRESETS = {
    "quick": dict(settings=EvalSettings(lengths=(4096,), n=1, gen=32), taus=(0.45,), bands=(0, 64, 256),
                  sweep_samples=1, a3_rhos=(0.1,)),
    "full": dict(settings=EvalSettings(lengths=(4096, 8192, 16384), n=4, gen=128), taus=(0.3, 0.45, 0.6, 0.75),
                 bands=(0, 32, 64, 128, 256, 512), sweep_samples=4, a3_rhos=(0.1, 0.2)),
}
"""``macattn eval --preset``: the settings, thresholds, bands, band-sweep samples and A3 ratios of each."""


def make_samples(settings: EvalSettings, encode: Callable, haystack_ids: Sequence[int], bos: Sequence[int] = (),
                 seed_offset: int = 0) -> list:
    """The deterministic sample list: for each length, task and ``i < n`` one ``tasks.Sample``."""
    rng = random.Random(settings.seed + seed_offset)
    hay = T.haystack_from(haystack_ids)
    return [T.make_sample(task, length, rng, encode, hay, bos=list(bos))
            for length in settings.lengths for task in settings.tasks for _ in range(settings.n)]
