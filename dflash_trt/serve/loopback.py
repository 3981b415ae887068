"""A dflash_trt Server under uvicorn on a loopback port, in a daemon thread of this process: what the tests, the
soak benchmark and examples use to talk HTTP to a real server without launching one."""

from __future__ import annotations

import socket
import threading
import time


class LoopbackServer:
    """uvicorn serving a dflash_trt Server on 127.0.0.1, in a daemon thread of this process."""

    def __init__(self, server):
        import uvicorn

        from dflash_trt.serve.server import create_app

        self.server = server
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.uvicorn.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Until the engine has no request left and nothing is in flight (plain ints, read from the caller's thread)."""
        gen = self.server.model.generator
        deadline = time.monotonic() + timeout
        while gen.has_work or self.server.in_flight:
            if time.monotonic() > deadline:
                raise RuntimeError("engine still busy")
            time.sleep(0.05)
