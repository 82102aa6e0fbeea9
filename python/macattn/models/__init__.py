"""The transformers integration, in one room: the attention hook site (``attention``), FastMKA's
model surgery (``mka``), the supported families (``architectures``), built-in models
(``builtin``), the trained checkpoint (``checkpoint``) and the plain generation loop
(``generation``)."""
