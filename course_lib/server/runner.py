"""Starting the server: ``python -m course_lib serve`` (in the foreground) and
``BackgroundServer`` (a real HTTP server on a uvicorn thread, for tests and notebooks).

Both bind their socket before uvicorn starts, so ``--port 0`` picks a free port with no
race, and the address printed (or ``BackgroundServer.url``) is the one really listening.
"""
from __future__ import annotations

import gc
import socket
import threading
import time

import uvicorn

from course_lib import settings
from course_lib.server.app import DEFAULT_MAX_BODY_BYTES, create_app


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP; without
    # it every reply waits ~40 ms for a delayed ACK (Nagle), which triples a bucketed update.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def serve(args) -> int:
    """The ``serve`` subcommand: build the engine, print where it listens, serve until stopped."""
    import torch

    from course_lib import Engine

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    api_key = args.api_key or settings.api_key()
    engine = Engine(args.model, device=device)
    app = create_app(engine, allow_weight_update=args.allow_weight_update, api_key=api_key,
                     max_body_bytes=int(args.max_body_mb * (1 << 20)))
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    gc.freeze()  # the engine lives as long as the server: the collector need never walk it again
    print(f"serving {args.model} on http://{host}:{port} (device {device}, weight routes "
          f"{'on' if args.allow_weight_update else 'off'}, API key {'required' if api_key else 'not required'})",
          flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


class BackgroundServer:
    """Serve ``engine`` on 127.0.0.1 (a free port) from a thread; use as a context manager.

    ``url`` is the base URL; ``worker.call_sync(fn)`` runs ``fn(engine)`` on the engine
    thread (the only safe way to look inside the engine while it serves).
    """

    def __init__(self, engine, allow_weight_update: bool = True, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, host: str = "127.0.0.1"):
        self.engine = engine
        self.app = create_app(engine, allow_weight_update, api_key, max_body_bytes)
        self.worker = self.app.state.worker
        self._sock = bind(host, 0)
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="http-server", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
