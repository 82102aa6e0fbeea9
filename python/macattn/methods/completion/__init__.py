"""macattn.methods.completion."""
