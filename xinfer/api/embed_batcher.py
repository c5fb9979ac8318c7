"""--embedding-model in the API process: requests' inputs wait here while a forward runs and go into
the next one together. One forward at a time, in the heavy-work pool (ApiState.offload), so the
event loop never blocks and the model's torch threads are not asked to run two batches at once.
The model (xinfer/embedding_model.py) and so torch are imported only when the flag is given."""
from __future__ import annotations

import asyncio

MAX_MERGED_INPUTS = 512  # inputs of several requests in one embed_ids call (it splits by padded tokens)


class EmbedBatcher:
    def __init__(self, model, offload):
        self.model, self.offload = model, offload  # offload: ApiState.offload
        self.waiting: list[tuple[list[list[int]], asyncio.Future]] = []
        self.task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return self.model.name

    async def embed(self, prompts: list[list[int]]):
        """Checked token id lists -> an [n, hidden] float32 array of unit vectors."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((prompts, fut))
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._run())
        return await fut

    async def _run(self) -> None:
        while self.waiting:
            take, n = [], 0
            while self.waiting and (not take or n + len(self.waiting[0][0]) <= MAX_MERGED_INPUTS):
                prompts, fut = self.waiting.pop(0)
                if not fut.done():  # a client that went away is not computed
                    take.append((prompts, fut))
                    n += len(prompts)
            if not take:
                continue
            flat = [p for prompts, _ in take for p in prompts]
            try:
                vecs = await self.offload(self.model.embed_ids, flat)
            except Exception as e:  # this batch's requests get the error (a 500), the next batch runs
                for _, fut in take:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            at = 0
            for prompts, fut in take:
                if not fut.done():
                    fut.set_result(vecs[at:at + len(prompts)])
                at += len(prompts)
