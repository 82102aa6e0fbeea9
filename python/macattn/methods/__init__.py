"""macattn.methods."""
