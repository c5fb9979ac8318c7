"""`xinfer serve --headless`: a node other than node 0 of an --nnodes cluster.

It runs no API and no scheduler: it listens to node 0 (xinfer/ipc/cluster.py) and, for each worker
generation node 0 starts, runs this node's ranks with node 0's configuration, handing them every
step plan through a shared-memory ring as node 0's scheduler does for its own ranks. A rank that
dies takes the generation down (node 0's rank 0 fails in its next collective, and node 0 restarts
every node's ranks: in-flight requests recompute, none is lost); a node 0 that goes silent stops
this node's ranks until it starts a new generation.
"""
from __future__ import annotations

import dataclasses
import logging
import signal
import time

import msgspec

from xinfer import process
from xinfer.config import EngineConfig
from xinfer.ipc import cluster
from xinfer.ipc.shm_ring import PeerDied
from xinfer.ipc.topology import Topology
from xinfer.workers.worker import Ranks

log = logging.getLogger("xinfer.headless")


def serve_headless(mine: EngineConfig, log_level: str) -> int:
    """`mine`: this node's command line; what describes the model comes from node 0, what is this
    node's own (--node-rank, --d, --cpu-ranks-bind) from here."""
    if mine.nnodes < 2 or mine.node_rank == 0:
        raise ValueError("--headless is for the nodes other than node 0: give --nnodes N and --node-rank 1..N-1")
    process.set_title(f"xinfer::node-{mine.node_rank}")
    signal.signal(signal.SIGTERM, _interrupt)
    sub = cluster.Subscriber(mine.master_addr, mine.master_port, mine.cluster_key)
    topology = Topology.create()
    ranks, current = None, None  # the generation running here: (node 0's session, its number)
    log.info("node %d of %d: waiting for node 0 at %s", mine.node_rank, mine.nnodes,
             cluster.address(mine.master_addr, mine.master_port))

    def stop(why: str):
        nonlocal ranks
        if ranks is not None:
            log.warning("stopping this node's ranks of generation %d: %s", current[1], why)
            ranks.close()
            ranks = None

    try:
        while True:
            msg = sub.recv(0.5)
            if msg is None:
                if ranks is not None and time.monotonic() - sub.heard > cluster.LOST:
                    stop(f"node 0 has been silent for {cluster.LOST:g}s")
                elif ranks is not None and (why := ranks.dead()):
                    stop(f"a rank died ({why})")
                continue
            ours = (msg.session, msg.gen) == current
            if isinstance(msg, cluster.Start) and not ours:  # a rank that died waits for the next generation
                stop("node 0 started a new generation")
                config = _config(msg.config, mine)
                current = (msg.session, msg.gen)
                log.info("generation %d: starting ranks %d..%d of %s", msg.gen, mine.node_rank * _local(config),
                         (mine.node_rank + 1) * _local(config) - 1, config.model)
                ranks = Ranks(config, topology, msg.gen, msg.num_blocks, log_level, results=False)
            elif isinstance(msg, cluster.Plan) and ours and ranks is not None:
                try:
                    ranks.plans.write(msg.payload)
                except PeerDied:
                    stop("a rank died")
            elif isinstance(msg, cluster.Stop) and ours:
                stop("node 0 stopped it")
    except KeyboardInterrupt:
        pass
    finally:
        stop("shutting down")
        sub.close()
    return 0


def _interrupt(*_):
    raise KeyboardInterrupt


def _local(config: EngineConfig) -> int:
    return config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes


def _config(frame: bytes, mine: EngineConfig) -> EngineConfig:
    theirs = msgspec.json.decode(frame, type=EngineConfig)
    if theirs.nnodes != mine.nnodes:
        raise ValueError(f"node 0 runs --nnodes {theirs.nnodes}, this node was started with --nnodes {mine.nnodes}")
    return dataclasses.replace(theirs, node_rank=mine.node_rank, devices=mine.devices,
                               cpu_ranks_bind=mine.cpu_ranks_bind)
