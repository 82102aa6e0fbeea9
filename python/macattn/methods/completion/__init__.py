"""Top-k retrieval with linear-attention completion (docs/spec.md §3, ``docs/completion.md``)."""
