"""The engine on its own thread, feeding many concurrent HTTP requests.

The engine loop runs on one thread and the HTTP event loop on another
(model steps hold the CPU; the event loop stays free for I/O). `paperback
serve` runs the engine on the main thread, the one that loaded the model,
and the HTTP server beside it: once the main thread has run OpenMP parallel
regions (loading does), libgomp serves a second thread's regions with
throttled spinning, since more threads than cores then wait on it, and a
decode step there took twice as long (SmolLM2 W4 at 2 threads: 36 against
18 ms). Without `run` on the calling thread, the loop gets a thread of its
own (tests). A request is submitted with a callback
queue: after every step the thread pushes each of the request's outputs as
the engine reports them (a streamed request asks for deltas, with stop
strings already held back; the others for the final output). Admission is
bounded: past `max_waiting` queued requests, `submit` refuses with
`Overloaded` instead of growing memory. Cancelling a request (a client that
went away) aborts it in the engine, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from paperback.engine.llm import LLMEngine, RequestOutput
from paperback.generation.sampling import SamplingParams
from paperback.server.metrics import ServerMetrics

log = logging.getLogger("paperback.server")


class Overloaded(Exception):
    """Too many requests are waiting; the client should retry later (HTTP 429)."""


class ShuttingDown(Exception):
    """The server stopped before the request finished (HTTP 503)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int = 64, model_name: str = "model",
                 own_thread: bool = True):
        """own_thread=False: the caller runs the loop itself (`run`)."""
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.metrics = ServerMetrics(model_name)
        self.finished = 0
        self._thread = None
        if own_thread:
            self._thread = threading.Thread(target=self.run, name="paperback-engine", daemon=True)
            self._thread.start()

    # --- called from the event loop ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise a PaperbackError if the request could never run on this engine (before it is queued)."""
        self.engine.check_request(prompt_ids, params)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue its RequestOutputs (or an Exception) arrive on."""
        with self._lock:
            if self.engine.num_waiting + self._inbox.qsize() >= self.max_waiting:
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
        return {**self.engine.stats(), "finished": self.finished}

    def shutdown(self) -> dict:
        """Stop the engine thread; a request still open fails cleanly (its route gets an error) and its blocks go
        back. Returns what was left: requests failed, and KV blocks and staging slots still held after that."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._thread is not None and self._thread.is_alive():  # mid-step: touching the engine now would race it
            return {"failed": None, "blocks_held": None, "staging_held": None}
        # Open streams include requests still in the inbox; the engine may hold requests whose abort is.
        open_requests = set(self._streams) | set(self.engine.requests)
        for request_id in open_requests:
            self._emit(request_id, ShuttingDown("the server is shutting down"))
            self.engine.abort(request_id)
        self._streams.clear()
        staging = self.engine.pool.staging
        return {"failed": len(open_requests), "blocks_held": self.engine.blocks.num_used,
                "staging_held": staging.num_slots - staging.available}

    # --- the engine thread ---------------------------------------------------------------------------------------
    def _emit(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.out.put_nowait, item)

    def run(self, keep_going=lambda: True) -> None:
        """The engine loop, on the calling thread, until `shutdown` or until keep_going() is false."""
        while not self._stop and keep_going():
            self._drain_inbox()
            if not self.engine.has_unfinished:
                self.metrics.update(self.stats())
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug, not user input: fail every open request rather than hang them
                log.exception("engine step failed")
                for request_id in list(self._streams):
                    self._emit(request_id, exc)
                    self.engine.abort(request_id)
                self._streams.clear()
                continue
            for output in outputs:
                self._emit(output.request_id, output)
                if output.finished:
                    self._finish(output)
            self.metrics.update(self.stats())

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item[0] == "add":
                _, request_id, prompt_ids, params = item
                if request_id not in self._streams:
                    continue  # cancelled before it reached the engine
                try:
                    self.engine.add_request(prompt_ids, params, request_id)
                except Exception as exc:
                    self._emit(request_id, exc)
                    self._streams.pop(request_id, None)
            else:
                self.engine.abort(item[1])
                self._streams.pop(item[1], None)

    def _finish(self, output: RequestOutput) -> None:
        self._streams.pop(output.request_id, None)
        self.finished += 1
        self.metrics.observe_finished(output)
