"""The API process entry: the supervisor (xinfer/launch.py) runs serve() in its own process."""
from __future__ import annotations

import logging
import os
import shutil

from xinfer import process
from xinfer.api import guard
from xinfer.api.app import create_app
from xinfer.config import EngineConfig
from xinfer.ipc.topology import Topology

__all__ = ["create_app", "serve"]  # create_app: for callers that build the app themselves

log = logging.getLogger("xinfer.api")


def serve(config: EngineConfig, topology: Topology, host: str, port: int, log_level: str = "info",
          max_queued_requests: int = 256, drain_timeout: float = 30.0, parent: int | None = None,
          api_options: dict | None = None) -> None:
    """The API process, started by the supervisor (xinfer/launch.py); `api_options`: create_app's
    keyword arguments (ui_port and ApiOptions fields)."""
    name = "xinfer::api"
    process.setup_logging(log_level, name)
    process.set_title(name)
    try:
        app = create_app(config, topology, max_queued_requests, drain_timeout, parent, **(api_options or {}))
    except Exception as e:  # a bad model path, an unreadable tokenizer: shown by the supervisor
        log.debug("start-up failed", exc_info=True)
        process.failed(name, process.error_message(e))
        raise SystemExit(1)
    log.info("serving %s on http://%s:%d", config.model or "the bundled SmolLM2-135M-Instruct", host, port)
    try:
        app.run(host=host, port=port, single_process=True, access_log=False, motd=False,
                protocol=guard.Protocol, ssl=app.ctx.ssl)  # guard.Protocol: its read deadline
    except OSError as e:  # the port is taken
        process.failed(name, f"cannot listen on {host}:{port}: {e.strerror or e}")
        raise SystemExit(1)
    if getattr(app.ctx, "orphaned", False):  # nobody waits for a clean exit: be gone at once
        shutil.rmtree(topology.rundir, ignore_errors=True)
        logging.shutdown()
        os._exit(1)
    if app.ctx.failed:
        raise SystemExit(1)  # the engine died
