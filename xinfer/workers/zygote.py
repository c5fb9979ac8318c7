"""Imported only in the fork server that model workers are forked from (fork_server.py's
worker_context): it names that process for ps and imports what every worker needs, so a worker
(or its replacement after a crash) starts with torch and the model code already loaded."""
import atexit
import os

from xinfer import process

process.set_title("xinfer::worker-fork")

import xinfer.workers.worker  # noqa: E402,F401

# The server holds nothing to clean up; unwinding torch's imports at its exit took ~0.6 s of CPU after
# the scheduler was gone. Its forked workers never run atexit handlers (multiprocessing ends them
# with os._exit), so this ends the server alone.
atexit.register(os._exit, 0)
