"""The evaluation's sample set: ``EvalSettings`` (lengths, tasks, samples per cell, decode steps, seed)
and ``make_samples``, the deterministic list of ``tasks.Sample`` both the harness (``run_eval``) and the
long-generation benchmark (``long_gen``) run on. Pure standard library, as ``tasks``."""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from macattn.evaluation import tasks as T

__all__ = ["EvalSettings", "make_samples"]


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


def make_samples(settings: EvalSettings, encode: Callable, haystack_ids: Sequence[int], bos: Sequence[int] = (),
                 seed_offset: int = 0) -> list:
    """The deterministic sample list: for each length, task and ``i < n`` one ``tasks.Sample``."""
    rng = random.Random(settings.seed + seed_offset)
    hay = T.haystack_from(haystack_ids)
    return [T.make_sample(task, length, rng, encode, hay, bos=list(bos))
            for length in settings.lengths for task in settings.tasks for _ in range(settings.n)]
