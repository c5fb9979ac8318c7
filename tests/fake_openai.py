"""A fake OpenAI-style streaming server for the load generator's tests (tests/test_bench.py); light to
import, so a test can also run it as a separate process."""
import asyncio
import json
import threading


class FakeServer:
    """OpenAI-style routes over plain asyncio: /v1/models, /metrics, and chat/completions that
    stream max_tokens chunks ("tok ") with small sleeps, then usage and [DONE]."""

    def __init__(self, first_s=0.02, gap_s=0.004, metrics=True, port=0):
        self.first_s, self.gap_s, self.metrics, self.port = first_s, gap_s, metrics, port
        self.requests = []
        self.hits = self.queries = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self.port = self.server.sockets[0].getsockname()[1]
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        async def stop():
            self.server.close()
            await self.server.wait_closed()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _handle(self, reader, writer):
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method, path, _ = line.decode().split(" ", 2)
                headers = {}
                while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    k, _, v = h.decode().partition(":")
                    headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                if not await self._route(method, path, body, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _send(self, writer, status, body, ctype="application/json"):
        data = body.encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        await writer.drain()
        return True

    async def _route(self, method, path, body, writer):
        if method == "GET" and path == "/v1/models":
            return await self._send(writer, 200, json.dumps({"object": "list", "data": [{"id": "fake"}]}))
        if method == "GET" and path == "/metrics":
            if not self.metrics:
                return await self._send(writer, 404, "not found", "text/plain")
            return await self._send(writer, 200, f"fake:prefix_cache_queries_total {self.queries}\n"
                                                 f"fake:prefix_cache_hits_total {self.hits}\n", "text/plain")
        if method != "POST" or path not in ("/v1/chat/completions", "/v1/completions"):
            return await self._send(writer, 404, json.dumps({"error": {"message": "no route"}}))
        req = json.loads(body)
        self.requests.append(req)
        if req.get("model") != "fake":
            return await self._send(writer, 404, json.dumps({"error": {"message": f"model {req.get('model')} "
                                                                                  "not found"}}))
        chat = path.endswith("chat/completions")
        n = int(req["max_tokens"])
        prompt = json.dumps(req.get("messages") or req.get("prompt"))
        n_prompt = len(prompt.split())
        self.queries += n_prompt
        self.hits += n_prompt // 2
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
                 "prompt_tokens_details": {"cached_tokens": n_prompt // 2}}
        if not req.get("stream"):
            await asyncio.sleep(self.first_s + self.gap_s * n)
            msg = {"message": {"role": "assistant", "content": "tok " * n}} if chat else {"text": "tok " * n}
            return await self._send(writer, 200, json.dumps({"choices": [{"index": 0, **msg}], "usage": usage}))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await asyncio.sleep(self.first_s)
        for i in range(n):
            ch = {"index": 0, "delta": {"content": "tok "}} if chat else {"index": 0, "text": "tok "}
            ch["finish_reason"] = "length" if i == n - 1 else None
            writer.write(b"data: " + json.dumps({"choices": [ch], "usage": None}).encode() + b"\n\n")
            await writer.drain()
            await asyncio.sleep(self.gap_s)
        writer.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        await writer.drain()
        return False  # Connection: close
