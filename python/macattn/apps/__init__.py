"""macattn.apps."""
