"""The engine on its own thread, feeding many concurrent HTTP requests.

The engine loop runs in one background thread (model steps hold the CPU;
the event loop stays free for I/O). A request is submitted with a callback
queue: after every step the thread pushes each request's new text (held back
by the longest stop string, so a stop string is never streamed) and, at the
end, its finished output. Admission is bounded: past `max_waiting` queued
requests, `submit` refuses with `Overloaded` instead of growing memory.
Cancelling a request (a client that went away) aborts it in the engine,
which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass, field

from paperback.engine.llm import LLMEngine, RequestOutput
from paperback.generation.sampling import SamplingParams
from paperback.server.metrics import ServerMetrics


class Overloaded(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 429)."""


@dataclass
class Delta:
    index: int  # which of the n completions
    text: str


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    sent: dict[int, int] = field(default_factory=dict)  # completion index -> characters streamed


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 64):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.metrics = ServerMetrics()
        self.finished = 0
        self._thread = threading.Thread(target=self._loop, name="paperback-engine", daemon=True)
        self._thread.start()

    # --- called from the event loop ---------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue its Delta items and final RequestOutput arrive on."""
        with self._lock:
            if len(self.engine.scheduler.waiting) + self._inbox.qsize() >= self.max_waiting:
                raise Overloaded(f"{self.max_waiting} requests are already waiting")
            stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_ids, params))
        self._wake.set()
        return stream.out

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stats(self) -> dict:
        blocks = self.engine.blocks
        return {"running": len(self.engine.scheduler.running), "waiting": len(self.engine.scheduler.waiting),
                "blocks_used": blocks.num_used, "blocks_free": blocks.num_free,
                "prefix_hit_rate": blocks.prefix_hit_rate, "finished": self.finished}

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # --- the engine thread ---------------------------------------------------------------------------------------
    def _emit(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)

    def _loop(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.scheduler.has_work:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                finished = self.engine.step()
            except Exception as exc:  # a bug, not user input: fail every open request rather than hang them
                for request_id in list(self._streams):
                    self._emit(request_id, exc)
                    self.engine.abort(request_id)
                self._streams.clear()
                continue
            self._stream_deltas()
            for output in finished:
                self._finish(output)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, request_id, prompt_ids, params = item
                try:
                    self.engine.add_request(prompt_ids, params, request_id)
                except Exception as exc:
                    self._emit(request_id, exc)
                    self._streams.pop(request_id, None)
            else:
                self.engine.abort(item[1])
                self._streams.pop(item[1], None)

    def _stream_deltas(self) -> None:
        for request_id, request in list(self.engine.requests.items()):
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            hold = max(map(len, request.params.stop), default=1) - 1
            for index, seq in enumerate(request.seqs):
                text = request.texts[seq.seq_id]
                safe = len(text) if seq.finish_reason else max(0, len(text) - hold)
                sent = stream.sent.get(index, 0)
                if safe > sent:
                    self._emit(request_id, Delta(index, text[sent:safe]))
                    stream.sent[index] = safe

    def _finish(self, output: RequestOutput) -> None:
        stream = self._streams.pop(output.request_id, None)
        if stream is not None:  # the rest of each completion's text, then the output itself
            for completion in output.outputs:
                sent = stream.sent.get(completion.index, 0)
                if len(completion.text) > sent:
                    stream.loop.call_soon_threadsafe(stream.out.put_nowait,
                                                     Delta(completion.index, completion.text[sent:]))
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, output)
        self.finished += 1
        self.metrics.observe_finished(output)
