"""macattn.methods.mka."""
