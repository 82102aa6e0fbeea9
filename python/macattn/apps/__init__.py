"""Applications on top of the engine: the main job (``generate``), the per-layer tuner
(``tune``), and the trainers (``finetune_mka``, ``distill_completion``, sharing
``trainer_common``)."""
