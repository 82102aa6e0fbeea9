"""The servers: the OpenAI-compatible HTTP server (``openai_server``) and the Triton Inference Server
pieces (``triton_repo`` writes a model repository, ``triton_model`` / ``triton_text`` are its Python-backend
models, ``triton_server`` starts and stops a tritonserver process)."""
