"""FastMKA: route-fused memory-keyed attention (docs/spec.md §2); composes with an attention method."""
