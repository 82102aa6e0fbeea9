"""Top-k retrieval with linear-attention completion (SPEC §3, ``docs/completion.md``)."""
