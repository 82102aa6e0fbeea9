"""FastMKA: route-fused memory-keyed attention (SPEC §2); composes with an attention method."""
