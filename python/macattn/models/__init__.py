"""macattn.models.builtin."""
