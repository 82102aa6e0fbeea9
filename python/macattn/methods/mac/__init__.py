"""MAC: match the pre-RoPE query against a ring of recent ones, reuse the matched step's
rectified attention summary, recompute band + tail, merge (docs/spec.md §1, ``docs/graph.md``)."""
