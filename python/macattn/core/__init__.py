"""The bottom layer: argument validation (``validation``), MAC's match rule (``threshold``),
attention summaries (``summaries``), attention reference math every method shares
(``attention``) and the per-request slot protocol (``slot_pool``). Imports nothing of macattn."""
