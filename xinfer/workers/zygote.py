"""Imported only in the fork server that model workers are forked from (fork_server.py's
worker_context): it names that process for ps and imports what every worker needs, so a worker
(or its replacement after a crash) starts with torch and the model code already loaded."""
from xinfer import process

process.set_title("xinfer::worker-fork")

import xinfer.workers.worker  # noqa: E402,F401
