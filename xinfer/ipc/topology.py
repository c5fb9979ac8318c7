"""Every ZMQ endpoint and shared-memory ring name of one launch, in one place.

The supervisor builds the Topology (one private 0700 runtime directory) and hands it to each
child; the offline Engine builds its own for its worker process. Names that change when a
child is restarted take the child's generation number.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from xinfer.ipc.channels import endpoint, runtime_dir


@dataclass(frozen=True)
class Topology:
    rundir: str

    @classmethod
    def create(cls) -> "Topology":
        return cls(runtime_dir())

    @property
    def launch(self) -> str:
        """Children -> supervisor: Started / Failed (xinfer/ipc/launch.py)."""
        return endpoint(self.rundir, "launch")

    @property
    def to_engine(self) -> str:
        """API -> engine core: GenerateRequest / Abort (xinfer/ipc/api.py); the API binds."""
        return endpoint(self.rundir, "to_engine")

    @property
    def from_engine(self) -> str:
        """Engine core and parser -> API: Ready, Stats, RequestError, TextBatch; the API binds."""
        return endpoint(self.rundir, "from_engine")

    @property
    def stop_hits(self) -> str:
        """Detokenizer -> engine core: StopHit; the engine core binds."""
        return endpoint(self.rundir, "stop_hits")

    def to_detokenizer(self, gen: int) -> str:
        return endpoint(self.rundir, f"to_detok-{gen}")

    def to_parser(self, gen: int) -> str:
        return endpoint(self.rundir, f"to_parser-{gen}")

    def plan_side(self, gen: int, rank: int = 0) -> str:
        """Step plans too large for a ring slot, in order (one channel per tensor-parallel rank)."""
        return endpoint(self.rundir, f"plan-side-{gen}" + (f"-{rank}" if rank else ""))

    def tp_store(self, gen: int) -> str:
        """The tensor-parallel ranks' rendezvous: a file (torch.distributed's FileStore), so that
        nothing listens on a network port for it."""
        return os.path.join(self.rundir, f"tp-store-{gen}")

    def result_side(self, gen: int) -> str:
        return endpoint(self.rundir, f"result-side-{gen}")

    def ring(self, kind: str, gen: int) -> str:
        """A shared-memory ring's name ("plan" or "result"): unique on the machine, as the runtime
        directory's name is."""
        return f"{os.path.basename(self.rundir)}-{gen}-{kind}"
