"""Attention methods behind one interface (``base.AttentionMethod``), one folder each with the
same file names (``config``, ``reference``, ``state``, ``ops``, ``backend``), listed in one
registry (``registry.METHODS``). docs/spec.md sections: MAC §1 (``mac``), FastMKA §2 (``mka``),
retrieval-completion §3 (``completion``), A3 §4 (``a3``); ``full`` is the baseline."""
