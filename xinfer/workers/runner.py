"""What the engine core needs of a model runner, in-process or in a worker process."""
from __future__ import annotations

import collections
import logging
import time
from typing import Protocol

from xinfer.errors import XinferError
from xinfer.ipc.step import StepPlan, StepResult

log = logging.getLogger("xinfer.engine_core")


class WorkerDied(RuntimeError):
    pass


class TooManyRestarts(XinferError):
    pass


class Runner(Protocol):
    num_blocks: int  # the KV cache's size, chosen by the runner once the weights are loaded
    restarts: int

    def submit(self, plan: StepPlan) -> None:
        """Send one step to run after those already sent; raises WorkerDied if the model is gone."""

    def collect(self) -> StepResult:
        """The result of the oldest step sent and not yet collected; raises WorkerDied if the model
        is gone. A step that raised comes back with `error` set and the runner's batch cleared."""

    def restart(self) -> None:
        """A fresh model state (same KV cache size); raises WorkerDied if it cannot start."""

    def dead(self) -> str | None:
        """Why the runner can't run (e.g. its process exited), or None."""

    def close(self) -> None: ...


class RestartBudget:
    """--max-restarts child restarts within --restart-window seconds, shared by every child
    the engine restarts (the worker, the detokenizer, the parser); one more is an error."""

    def __init__(self, max_restarts: int, window: float):
        self.max, self.window = max_restarts, window
        self.times: collections.deque[float] = collections.deque()
        self.seconds: dict[str, tuple[int, float]] = {}  # child -> (restarts, seconds they took in all)

    def took(self, child: str, seconds: float) -> None:
        """A restart is done: from noticing the death to the new child being up."""
        n, total = self.seconds.get(child, (0, 0.0))
        self.seconds[child] = (n + 1, total + seconds)
        log.info("%s restarted in %.2fs", child, seconds)

    def record(self, child: str, why: str) -> None:
        now = time.monotonic()
        self.times.append(now)
        while self.times and now - self.times[0] > self.window:
            self.times.popleft()
        if len(self.times) > self.max:
            raise TooManyRestarts(f"{child} died ({why}): {len(self.times)} child restarts within "
                                  f"{self.window:g}s, more than --max-restarts {self.max} allows; giving up")
