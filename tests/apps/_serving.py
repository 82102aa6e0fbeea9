"""The OpenAI-compatible app served by uvicorn on 127.0.0.1 in a thread, for the tests that talk to it over HTTP."""
import contextlib
import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(llm, name: str = "builtin", **config):
    """Serve ``llm`` (``build_app``, ``server_config(**config)``: as ``macattn serve`` does) until the block ends;
    yields the base URL ``http://127.0.0.1:PORT``. The LLM is shut down afterwards."""
    import uvicorn

    from macattn.apps.serving.openai_server import build_app, server_config

    port = free_port()
    srv = uvicorn.Server(server_config(build_app(llm, name), "127.0.0.1", port, **config))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        llm.shutdown()
