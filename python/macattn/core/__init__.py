"""macattn.core."""
