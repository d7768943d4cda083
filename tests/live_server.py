"""A specsample server running in a background thread of the test process, on a free port."""

from __future__ import annotations

import socket
import threading
import time

import openai
import uvicorn

from specsample.server.app import build_app
from specsample.server.state import SpecServer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, server: SpecServer) -> None:
        self.port = free_port()
        self.server = server
        self.uvicorn = uvicorn.Server(
            uvicorn.Config(build_app(server), host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "unused", cls=openai.OpenAI):
        return cls(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def close(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(timeout=30)
