"""The API side of the engine core: requests go out over ZMQ, outputs come back to one queue per
request, trimmed of what a restarted detokenizer/parser resends."""
from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from xinfer import process
from xinfer.api.metrics import Metrics
from xinfer.api.protocol import ApiError
from xinfer.errors import InvalidRequestError
from xinfer.ipc.api import Abort, FromEngine, GenerateRequest, Ready, RequestError, Stats, ToEngine
from xinfer.ipc.channels import Codec, socket
from xinfer.ipc.step import pack_ids
from xinfer.ipc.text import TextBatch
from xinfer.ipc.topology import Topology

log = logging.getLogger("xinfer.api")


class EngineClient:
    """The API side of the engine core: one queue per in-flight request. The supervisor starts
    the engine core; both find each other's sockets in the supervisor's runtime directory."""

    def __init__(self, topology: Topology, metrics: Metrics, on_death):
        self.on_death = on_death
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.push = socket(self.ctx, zmq.PUSH, topology.to_engine, bind=True)
        self.pull = socket(self.ctx, zmq.PULL, topology.from_engine, bind=True)
        self.tx, self.rx = Codec(ToEngine), Codec(FromEngine | TextBatch)
        self.queues: dict[str, asyncio.Queue] = {}
        self.ready: Ready | None = None
        self.dead = False

    async def pump(self):
        """Route engine outputs to their requests; notice an engine that died."""
        while True:
            if await self.pull.poll(1000):
                msg = self.rx.decode(await self.pull.recv())
                if isinstance(msg, TextBatch):
                    for o in msg.items:
                        q = self.queues.get(o.request_id)
                        if q is not None:
                            q.put_nowait(o)
                elif isinstance(msg, RequestError):
                    q = self.queues.get(msg.request_id)
                    if q is not None:
                        q.put_nowait(InvalidRequestError(msg.message))
                elif isinstance(msg, Stats):
                    self.metrics.stats = msg
                elif isinstance(msg, Ready):
                    self.ready = msg
                    log.info("engine ready: %s, max_model_len %d", msg.model, msg.max_model_len)
            elif self.ready is not None and not process.pid_alive(self.ready.pid) and not self.dead:
                self.dead = True
                log.error("the engine core (pid %d) exited; stopping the server", self.ready.pid)
                for q in self.queues.values():
                    q.put_nowait(RuntimeError("the engine stopped"))
                await asyncio.sleep(0.2)  # let streams send their error event
                self.on_death()

    async def generate(self, request_id: str, prompt_ids: list[int], params, parse=None,
                       keepalive: float | None = None):
        """Yield the TextDeltas of one request until all its choices finish, trimmed of what was
        already sent (a restarted detokenizer/parser resends); None after `keepalive` s of silence."""
        if self.dead:
            raise RuntimeError("the engine stopped")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = q
        remaining = params.n
        record = self.metrics.request(len(prompt_ids))
        seen = [_Seen() for _ in range(params.n)]
        finished = set()
        stop_after_call = parse is not None and parse.single_call and not parse.held  # held: the grammar ends it
        getter = None
        try:
            images = list(getattr(prompt_ids, "images", ()))  # a chat prompt's (xinfer/api/media.Prompt)
            request = GenerateRequest(request_id, pack_ids(prompt_ids), params, parse, images)
            await self.push.send(self.tx.encode(request))
            while remaining:
                # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that lands as an item
                # arrives, and a client that went away would never abort its request.
                getter = getter or asyncio.ensure_future(q.get())
                if not (await asyncio.wait({getter}, timeout=keepalive))[0]:
                    yield None
                    continue
                item, getter = getter.result(), None
                if isinstance(item, Exception):
                    raise item
                if item.index in finished:
                    continue
                if item.error is not None:
                    raise self._ended(item)
                new_tokens = seen[item.index].trim(item)
                if stop_after_call and item.tool_calls and not item.finish_reason:  # the call asked for is in
                    await self.push.send(self.tx.encode(Abort(request_id, item.index)))
                record.tokens(new_tokens)
                if item.finish_reason:
                    finished.add(item.index)
                    remaining -= 1
                    record.choice_done(item.finish_reason, item.total_tokens, item.queue_time)
                yield item
            record.done()
        finally:
            if getter is not None:
                getter.cancel()
            self.queues.pop(request_id, None)
            if remaining:  # the client went away (or an error): free the request's KV blocks now
                record.aborted(remaining)
                await self.push.send(self.tx.encode(Abort(request_id)))

    def _ended(self, item) -> Exception:
        """The engine ended a choice with an error: --max-queue-wait (overloaded: 503, retry) or the
        poison-pill rule (this request breaks the model: 400)."""
        if item.finish_reason == "timeout":
            self.metrics.reject("queue_timeout")
            return ApiError(f"{item.error}; retry later", status=503, kind="service_unavailable", retry_after=1)
        return InvalidRequestError(item.error, code="request_failed")

    def close(self):
        self.push.close()
        self.pull.close()


class _Seen:
    """How much of one choice's streams the client has: resent parts are cut off."""

    def __init__(self):
        self.content = self.reasoning = self.tokens = 0
        self.args: dict[int, int] = {}  # tool call index -> argument characters sent
        self.prompt_logprobs = False

    def trim(self, o) -> int:
        """Cut what was sent already out of `o`; returns how many new tokens it brings."""
        o.text, self.content = _cut(o.text, o.offset, self.content)
        o.reasoning, self.reasoning = _cut(o.reasoning, o.reasoning_offset, self.reasoning)
        calls = []
        for c in o.tool_calls:
            have = self.args.get(c.index)
            if have is not None:
                c.id = c.name = None
            c.arguments, self.args[c.index] = _cut(c.arguments, c.offset, have or 0)
            if have is None or c.arguments:
                calls.append(c)
        o.tool_calls = calls
        new = max(0, o.total_tokens - self.tokens)
        if o.logprobs:
            skip = max(0, len(o.logprobs) - new)
            o.logprobs = o.logprobs[skip:]
            o.logprob_token_ids = o.logprob_token_ids[4 * skip:]  # int32 ids
        self.tokens = max(self.tokens, o.total_tokens)
        if o.prompt_logprobs is not None:
            if self.prompt_logprobs:
                o.prompt_logprobs = None
            self.prompt_logprobs = True
        return new


def _cut(text: str, offset: int, have: int) -> tuple[str, int]:
    """(the part of text at `offset` not yet sent, the new sent length)."""
    end = offset + len(text)
    return text[max(0, have - offset):], max(have, end)
