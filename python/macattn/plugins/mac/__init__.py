"""The MAC op family: ``macattn::mac_match`` (nearest ring query, threshold, validity) and
``macattn::mac_attend`` (split-KV attention, merge, ring append), and the decode plan that runs both as
one step.

* ``match_kernel.py`` / ``match_reduce.py`` — the match's Triton kernel and its partials' reduction;
  ``two_stage.py`` — the two-stage match over a sketch ring; ``match_onepass.py`` — the AOT
  (TensorRT plugin) kernel; ``match_op.py`` — the CUDA op implementation; ``match_plugin.py`` — the
  ``mac::match`` TensorRT plugin.
* ``attend_kernel.py`` / ``attend_plan.py`` — attention, merge and ring append, and the device-side work
  split; ``persistent.py`` — the whole step as one launch; ``attend_onepass.py``, ``attend_op.py``,
  ``attend_plugin.py`` — as for the match.
* ``decode_plan.MacDecodePlan`` — plan once per batch bucket, run per step (the fused MAC step and the
  full-attention path), CUDA-graph capturable; the attend op runs an attend-only plan.

Importing this package needs nothing beyond torch; the kernel, op and plan modules need triton.
"""
