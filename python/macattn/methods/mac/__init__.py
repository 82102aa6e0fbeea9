"""macattn.methods.mac."""
