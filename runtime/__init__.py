"""Runtime: decode state, generation loop, serving."""
