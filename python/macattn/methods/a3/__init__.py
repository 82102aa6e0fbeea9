"""A3 KV-cache fusion for RAG prompts (docs/spec.md §4, ``docs/a3.md``): chunk K/V reused, a
question-aware share of document tokens recomputed. A prefill-only method."""
