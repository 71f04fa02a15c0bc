"""Soak: `paperback serve` held at 64 concurrent clients for 30 minutes of mixed, abusive traffic, then SIGTERM.

    .venv/bin/python benchmarks/bench_soak.py [--minutes 30] [--clients 64] [--kv-cache-dtype int8]
        [--threads 2] [--tag NAME]

The server reads SmolLM2 at W4 (the checkpoint bench_llamacpp.py pairs with the bundled Q4_1 file) with a
quantized KV cache (int8 by default, so prefix hits come from kept exact copies). Each client sends, one after
another, seeded requests: chat requests sharing a system prompt (WikiText-2, as bench_llamaserver.py builds
them), streamed or not, half each; one in ten streamed requests hangs up after a few tokens and one in ten
plain ones gives up after a second (random disconnects); one in twenty is malformed (bad JSON, a missing
field, an unknown field, a negative max_tokens, a prompt longer than the context, a wrong type). The server's
RSS is sampled every few seconds. After the last minute the clients keep going and the server gets SIGTERM:
every request then in flight must finish or fail cleanly, the server must exit, and its last log line must
report every KV block and staging slot free.

Checks, each reported pass or fail with its numbers:
- peak RSS flat after warm-up: the largest RSS after the first five minutes within 5% of the largest in them;
- no unexpected 5xx (none at all), and every valid request answered (200) or refused with 429, apart from
  those the client itself hung up on;
- latency steady: p99 of a finished request's latency and of time to first token in the last five minutes
  within 25% of the first five minutes';
- shutdown: every request in flight at SIGTERM finished or failed cleanly (a complete answer, or an error
  status or closed connection, never a hang), the server exited within its grace period, with no block held.

Writes benchmarks/results/soak_<kv>[_<tag>].json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_llamacpp import model_files, quantized_checkpoint  # noqa: E402
from bench_llamaserver import Server, free_port, percentile, request_set  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402

from paperback.cli.output import print_table  # noqa: E402
from paperback.loading.tokenizer import tokenizer_from_dir  # noqa: E402

WINDOW_S = 300  # warm-up, and the first and last stretches whose latency p99 are compared (a third of a short run)
SHUTDOWN_GRACE_S = 180
RSS_EVERY_S = 5.0


def malformed(rng: random.Random, context: int) -> tuple[bytes, str]:
    """A request body the server must refuse with a 4xx, and what is wrong with it."""
    kinds = [
        (b'{"model": "model", "messages": [', "bad JSON"),
        (json.dumps({"model": "model"}).encode(), "no messages"),
        (json.dumps({"model": "model", "messages": [{"role": "user", "content": "hi"}],
                     "frobnicate": 1}).encode(), "unknown field"),
        (json.dumps({"model": "model", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": -5}).encode(), "negative max_tokens"),
        (json.dumps({"model": "model", "messages": [{"role": "user", "content": "the " * (2 * context)}],
                     "max_tokens": 8}).encode(), "prompt longer than the context"),
        (json.dumps({"model": "model", "messages": [{"role": "user", "content": "hi"}],
                     "temperature": "hot"}).encode(), "temperature of the wrong type"),
    ]
    return kinds[rng.randrange(len(kinds))]


class Soak:
    def __init__(self, port: int, requests: list, context: int, seed: int):
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        self.requests, self.context, self.seed = requests, context, seed
        self.records: list[dict] = []
        self.stopping = False  # SIGTERM sent: requests started from now on are not counted as valid traffic
        self.in_flight: dict[int, dict] = {}

    async def one(self, client, rng: random.Random, n: int) -> dict:
        import httpx

        start = time.monotonic()
        record = {"start": start - self.t0, "kind": "valid", "status": 0}
        self.in_flight[n] = record
        try:
            if rng.random() < 0.05:
                body, what = malformed(rng, self.context)
                record.update(kind="malformed", what=what)
                response = await client.post(self.url, content=body, headers={"content-type": "application/json"},
                                             timeout=120)
                record["status"] = response.status_code
                return record
            request = self.requests[rng.randrange(len(self.requests))]
            stream = rng.random() < 0.5
            hang_up = rng.random() < 0.1
            payload = {"model": "model", "messages": request.messages, "max_tokens": request.max_tokens,
                       "temperature": 0.7, "seed": rng.randrange(2 ** 31), "stream": stream}
            record.update(stream=stream)
            if not stream:
                if hang_up:  # gives up after a second: the connection closes under the server
                    record["kind"] = "disconnect"
                    try:
                        response = await client.post(self.url, json=payload, timeout=1.0)
                        record["status"] = response.status_code
                    except httpx.TimeoutException:
                        record["status"] = "hung up"
                    return record
                response = await client.post(self.url, json=payload, timeout=None)
                record["status"] = response.status_code
                if response.status_code == 200:
                    record["complete"] = response.json()["choices"][0]["finish_reason"] is not None
                    record["ttft_s"] = record["latency_s"] = time.monotonic() - start
                return record
            stop_after = rng.randrange(1, 8) if hang_up else None
            if hang_up:
                record["kind"] = "disconnect"
            tokens = 0
            async with client.stream("POST", self.url, json=payload, timeout=None) as response:
                record["status"] = response.status_code
                if response.status_code != 200:
                    await response.aread()
                    return record
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        record["complete"] = True
                        break
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            record["stream_error"] = event["error"].get("message", "")[:200]
                            break
                        if tokens == 0:
                            record["ttft_s"] = time.monotonic() - start
                        tokens += 1
                        if stop_after is not None and tokens >= stop_after:
                            record["status"] = "hung up"
                            break
            if record.get("complete"):
                record["latency_s"] = time.monotonic() - start
            return record
        except httpx.HTTPError as exc:
            record["error"] = type(exc).__name__
            return record
        finally:
            record["end"] = time.monotonic() - self.t0
            record["after_sigterm"] = self.stopping
            self.in_flight.pop(n, None)

    async def client(self, c: int, until: float) -> None:
        import httpx

        rng = random.Random(self.seed * 1000 + c)
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits) as client:
            n = 0
            while time.monotonic() < until:
                record = await self.one(client, rng, c * 10 ** 6 + n)
                self.records.append(record)
                n += 1
                if record.get("error") and self.stopping:
                    return  # the server no longer takes connections


def sample_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


async def soak(server: Server, soak_state: Soak, clients: int, seconds: float) -> tuple[list, dict]:
    """Run the clients for `seconds`, then SIGTERM with the clients still sending; returns RSS samples and what
    the shutdown did."""
    rss: list[tuple[float, int]] = []
    soak_state.t0 = time.monotonic()
    end = soak_state.t0 + seconds
    tasks = [asyncio.ensure_future(soak_state.client(c, end + SHUTDOWN_GRACE_S)) for c in range(clients)]
    while time.monotonic() < end:
        value = sample_rss(server.proc.pid)
        if value is not None:
            rss.append((time.monotonic() - soak_state.t0, value))
        minutes = (time.monotonic() - soak_state.t0) / 60
        if len(rss) % 60 == 1:
            done = len(soak_state.records)
            print(f"{minutes:5.1f} min: {done} requests, RSS {rss[-1][1] / 2 ** 20:.0f} MiB", flush=True)
        await asyncio.sleep(RSS_EVERY_S)
    in_flight = list(soak_state.in_flight.values())  # the records themselves: they fill in as requests end
    soak_state.stopping = True
    sigterm_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    exited_s = None
    while time.monotonic() - sigterm_at < SHUTDOWN_GRACE_S:
        pid, _, usage = os.wait4(server.proc.pid, os.WNOHANG)
        if pid:
            exited_s = time.monotonic() - sigterm_at
            server.peak_rss_bytes = server.rss.result(usage)
            server.proc.returncode = 0
            break
        await asyncio.sleep(0.2)
    if exited_s is None:
        server.proc.kill()
    await asyncio.sleep(5)  # the clients see the closed socket
    hung = [r for r in in_flight if "end" not in r]
    for r in hung:
        r["hung"] = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return rss, {"in_flight": len(in_flight), "exited_s": exited_s, "records": in_flight, "hung": len(hung)}


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="int8")
    parser.add_argument("--kv-memory", type=int, default=256 * 2 ** 20, help="bytes of KV cache")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    add_tag_arg(parser)
    args = parser.parse_args()
    warn_if_busy()
    source, _ = model_files("smollm2")
    checkpoint = quantized_checkpoint("smollm2", source, "W4a-g32, head W8")
    requests = request_set(tokenizer_from_dir(checkpoint), 256, args.seed, 96, 192, 128)
    port = free_port()
    log = Path("/tmp") / f"paperback-soak-{args.kv_cache_dtype}.log"
    argv = [sys.executable, "-m", "paperback", "serve", str(checkpoint), "--port", str(port),
            "--kv-cache-dtype", args.kv_cache_dtype, "--kv-memory", str(args.kv_memory),
            "--max-model-len", str(args.max_model_len), "--decode-activations", "int8",
            "--served-model-name", "model"]
    print(f"soak: {args.clients} clients for {args.minutes:g} min against {' '.join(argv[2:])}", flush=True)
    state = Soak(port, requests, args.max_model_len, args.seed)
    with Server(argv, port, log, {"OMP_NUM_THREADS": str(args.threads)}) as server:
        rss, shutdown = asyncio.run(soak(server, state, args.clients, args.minutes * 60))
    report = judge(state.records, rss, shutdown, log, args.minutes * 60)
    warn_if_busy(args.threads)
    print_table(f"soak: paperback serve, {args.clients} clients, {args.minutes:g} min, KV {args.kv_cache_dtype}",
                ["check", "measured", "held"],
                [[c["check"], c["measured"], "yes" if c["passed"] else "NO"] for c in report["checks"]])
    write_results(results_name(f"soak_{args.kv_cache_dtype}", args.tag), {
        "clients": args.clients, "minutes": args.minutes, "threads": args.threads, "server": argv[3:],
        "checkpoint": str(checkpoint), "peak_rss_bytes": server.peak_rss_bytes, **report})
    return 0 if all(c["passed"] for c in report["checks"]) else 1


def judge(records: list[dict], rss: list, shutdown: dict, log: Path, seconds: float) -> dict:
    before = [r for r in records if not r["after_sigterm"]]
    counts: dict[str, int] = {}
    for r in before:
        counts[f"{r['kind']} {r['status']}"] = counts.get(f"{r['kind']} {r['status']}", 0) + 1
    server_errors = [r for r in records if isinstance(r["status"], int) and r["status"] >= 500]
    valid = [r for r in before if r["kind"] == "valid"]
    unanswered = [r for r in valid if r["status"] not in (200, 429) or (r["status"] == 200 and not r.get("complete"))]
    malformed = [r for r in before if r["kind"] == "malformed"]
    refused_badly = [r for r in malformed if not (isinstance(r["status"], int) and 400 <= r["status"] < 500)]

    window = min(WINDOW_S, seconds / 3)

    def p99(field: str, lo: float, hi: float) -> float | None:
        return percentile([r[field] for r in valid if r["status"] == 200 and field in r and lo <= r["start"] < hi],
                          99)

    first = {f: p99(f, 0, window) for f in ("latency_s", "ttft_s")}
    last = {f: p99(f, seconds - window, seconds) for f in ("latency_s", "ttft_s")}
    warm = max((v for t, v in rss if t < window), default=0)
    after = max((v for t, v in rss if t >= window), default=warm)
    lines = log.read_text().splitlines() if log.exists() else []
    stopped = next((line for line in reversed(lines) if "shut down" in line), "")
    flight = shutdown["records"]
    clean = [r for r in flight if not r.get("hung") and (
        r.get("complete") or r.get("error") or r.get("stream_error") or r["status"] == "hung up"
        or (isinstance(r["status"], int) and r["status"] not in (0, 200)))]
    tracebacks = sum("Traceback" in line for line in lines)
    checks = [
        {"check": "peak RSS after warm-up within 5% of warm-up's",
         "measured": f"{warm / 2 ** 20:.0f} -> {after / 2 ** 20:.0f} MiB ({after / warm - 1:+.1%})",
         "passed": after <= 1.05 * warm},
        {"check": "no 5xx", "measured": f"{len(server_errors)}", "passed": not server_errors},
        {"check": "valid requests answered or 429",
         "measured": f"{len(valid) - len(unanswered)} of {len(valid)}", "passed": not unanswered},
        {"check": "malformed requests refused with 4xx",
         "measured": f"{len(malformed) - len(refused_badly)} of {len(malformed)}", "passed": not refused_badly},
    ]
    for field, name in (("latency_s", "request latency"), ("ttft_s", "time to first token")):
        ratio = last[field] / first[field] if first[field] and last[field] else None
        checks.append({"check": f"{name} p99, last 5 min within 25% of first 5 min",
                       "measured": f"{first[field]:.2f} -> {last[field]:.2f} s" if ratio else "-",
                       "passed": ratio is not None and ratio <= 1.25})
    checks += [
        {"check": "requests in flight at SIGTERM finished or failed cleanly",
         "measured": f"{len(clean)} of {shutdown['in_flight']}",
         "passed": not shutdown["hung"] and len(clean) == shutdown["in_flight"]},
        {"check": "server exited after SIGTERM",
         "measured": "-" if shutdown["exited_s"] is None else f"{shutdown['exited_s']:.1f} s",
         "passed": shutdown["exited_s"] is not None},
        {"check": "every KV block and staging slot free at exit", "measured": stopped.split("shut down:")[-1].strip()
         or "no shutdown line", "passed": "every KV block free" in stopped},
        {"check": "no traceback in the server log", "measured": str(tracebacks), "passed": tracebacks == 0},
    ]
    return {"checks": checks, "counts": counts, "requests": len(before),
            "latency_p99_s": {"first": first, "last": last},
            "rss": [[round(t, 1), v] for t, v in rss], "shutdown": {
                "in_flight": shutdown["in_flight"], "hung": shutdown["hung"], "exited_s": shutdown["exited_s"],
                "outcomes": sorted({str(r.get("status")) + (" complete" if r.get("complete") else "")
                                    for r in flight}), "log": stopped}}


if __name__ == "__main__":
    raise SystemExit(main())
