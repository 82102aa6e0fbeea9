"""macattn.methods.a3."""
