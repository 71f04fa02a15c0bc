"""`paperback serve` beside llama.cpp's `llama-server` on the same CPU, W4 bytes and KV bytes, over HTTP.

    .venv/bin/python benchmarks/bench_llamaserver.py [--model smollm2|llama-3.2-1b] [--clients 1 4 16 64]
        [--requests-per-client 2] [--min-requests 16] [--threads 2] [--kv-cache-dtype fp16 ...]
        [--prefix-caching on|off|both] [--tag NAME]

A fixed, seeded request set: chat requests that share one system prompt (the opening of a WikiText-2 article),
each with a WikiText-2 paragraph as the user turn and as many output tokens as the paragraph after it has
(clipped to --max-output), greedy, EOS ignored so both servers write the same number of tokens, streamed with
usage. At each client count C, C clients send the requests as fast as answers come back; each server is
started fresh for the level with C slots (`llama-server -np C --kv-unified`: one KV pool the slots share) and
a KV pool of C x --slot-tokens f16 token states (paperback: `--kv-memory` of the same bytes, fp16, prefix
caching on, at most C sequences); both read the same W4 bytes (llama.cpp Q4_0 against paperback's W4s-g32
with a W4a-g32 head, as bench_llamacpp.py pairs them; SmolLM2: its bundled Q4_1 file against W4a-g32 with a
W8 head). Reported per level and server: output tokens/s and requests/s over the level's wall time, time to
first token p50/p99, inter-token latency p99 (gaps between streamed tokens, as vLLM's benchmark counts them),
failed requests, the server's peak RSS, and paperback's prefix-cache hit rate (from its /metrics).
`--kv-cache-dtype` runs paperback once per KV format in the same KV bytes (a quantized format holds more tokens
there; its running sequences may be capped so that their exact staging fits), and `--prefix-caching both`
runs each with and without the prefix cache, which shows what a hit on the shared system prompt saves. Writes
benchmarks/results/llamaserver_<model>[_<tag>].json.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from paperback.cli.output import print_table
from paperback.loading.tokenizer import tokenizer_from_dir

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "peers"))
import llamacpp_tools  # noqa: E402
from peak_rss import PeakRSS  # noqa: E402
from bench_llamacpp import model_files, quantized_checkpoint  # noqa: E402
from results_io import add_tag_arg, benchmark_parser, results_name, warn_if_busy, write_results  # noqa: E402

# model -> (llama.cpp's file, paperback's checkpoint of no more bytes)
PAIRS = {"smollm2": ("bundled", "W4a-g32, head W8"), "llama-3.2-1b": ("Q4_0", "W4s-g32, head W4a-g32")}
READY_TIMEOUT_S = 600


@dataclass(frozen=True)
class Request:
    messages: list
    max_tokens: int


def request_set(tokenizer, count: int, seed: int, system_tokens: int, max_prompt: int, max_output: int) -> list:
    """`count` chat requests sharing a system prompt; user turns and output lengths from WikiText-2 paragraphs."""
    from paperback.evaluation import load_text

    paragraphs = [p.strip() for p in load_text("wikitext2").split("\n")]
    paragraphs = [p for p in paragraphs if len(p) > 80 and not p.startswith("=")]
    system = tokenizer.decode(tokenizer.encode(" ".join(paragraphs[:3]), add_special_tokens=False)[:system_tokens])
    picks = random.Random(seed).sample(range(3, len(paragraphs) - 1), count)
    out = []
    for i in picks:
        user = tokenizer.decode(tokenizer.encode(paragraphs[i], add_special_tokens=False)[:max_prompt])
        follow = len(tokenizer.encode(paragraphs[i + 1], add_special_tokens=False))
        out.append(Request([{"role": "system", "content": system}, {"role": "user", "content": user}],
                           max(8, min(follow, max_output))))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process: started, awaited until /health answers, stopped with SIGTERM; its own peak RSS
    (peak_rss.PeakRSS)."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None):
        self.argv, self.port, self.log, self.env = argv, port, log, env
        self.peak_rss_bytes = 0

    def __enter__(self):
        import httpx

        self.log_file = open(self.log, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(self.env or {})})
        self.rss = PeakRSS(self.proc.pid)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.argv[0]} exited ({self.proc.returncode}); its log: {self.log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise SystemExit(f"{self.argv[0]} was not ready in {READY_TIMEOUT_S} s; its log: {self.log}")

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            _, _, usage = os.wait4(self.proc.pid, 0)
        except ChildProcessError:  # already reaped (it exited before the end)
            usage = None
        self.peak_rss_bytes = self.rss.result(usage)
        self.log_file.close()


def token_event(choice: dict) -> bool:
    """Whether a streamed chunk's choice carries a generated token (not a bare role header or the finish)."""
    if choice.get("finish_reason"):
        return False
    delta = choice.get("delta") or {}
    return not ("role" in delta and not delta.get("content"))


async def one_request(client, url: str, model: str, request: Request) -> dict:
    body = {"model": model, "messages": request.messages, "max_tokens": request.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens, status = [], None, 0
    try:
        async with client.stream("POST", url, json=body, timeout=None) as response:
            status = response.status_code
            if status != 200:
                return {"ok": False, "status": status, "error": (await response.aread()).decode()[:300]}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if any(token_event(c) for c in event.get("choices") or ()):
                    stamps.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except Exception as exc:  # a dropped connection is a failed request, counted, not a crash of the benchmark
        return {"ok": False, "status": status, "error": type(exc).__name__}
    if not stamps:
        return {"ok": False, "status": status, "error": "no tokens"}
    return {"ok": True, "ttft_s": stamps[0] - start, "gaps_s": [b - a for a, b in zip(stamps, stamps[1:])],
            "tokens": tokens if tokens is not None else len(stamps), "latency_s": time.perf_counter() - start}


async def run_level(port: int, model: str, requests: list, clients: int) -> tuple[list[dict], float]:
    import httpx

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    queue = list(reversed(requests))
    records: list[dict] = []
    # a connection per request: llama-server closes idle keep-alive connections under the client (a reused one
    # then fails as a protocol error)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker():
            while queue:
                records.append(await one_request(client, url, model, queue.pop()))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return records, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(records: list[dict], wall_s: float) -> dict:
    done = [r for r in records if r["ok"]]
    gaps = [g for r in done for g in r["gaps_s"]]
    return {"requests": len(records), "failed": len(records) - len(done), "wall_s": wall_s,
            "output_tokens": sum(r["tokens"] for r in done),
            "output_tokens_per_s": sum(r["tokens"] for r in done) / wall_s, "requests_per_s": len(done) / wall_s,
            "ttft_p50_s": percentile([r["ttft_s"] for r in done], 50),
            "ttft_p99_s": percentile([r["ttft_s"] for r in done], 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "latency_p50_s": statistics.median(r["latency_s"] for r in done) if done else None,
            "errors": sorted({f"{r['status']}: {r.get('error', '')}" for r in records if not r["ok"]})}


def prefix_hit_rate(port: int) -> float | None:
    """paperback's prompt tokens found in its prefix cache over those looked up (its /metrics)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    found = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name):
                found[name] = float(line.rsplit(" ", 1)[1])
    queries = found.get("vllm:prefix_cache_queries_total")
    return found.get("vllm:prefix_cache_hits_total", 0.0) / queries if queries else None


def main() -> int:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--model", default="smollm2", choices=list(PAIRS))
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=96, help="the shared system prompt's length")
    parser.add_argument("--max-prompt", type=int, default=192, help="a user turn's tokens at most")
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--slot-tokens", type=int, default=512, help="KV token states per client slot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["fp16"],
                        help="paperback's KV formats, each run in the same KV bytes")
    parser.add_argument("--prefix-caching", choices=["on", "off", "both"], default="on",
                        help="paperback's prefix cache")
    add_tag_arg(parser)
    args = parser.parse_args()
    warn_if_busy()
    source, ggufs = model_files(args.model)
    gguf_name, checkpoint_name = PAIRS[args.model]
    checkpoint = quantized_checkpoint(args.model, source, checkpoint_name)
    tokenizer = tokenizer_from_dir(checkpoint)
    kv_per_token = kv_bytes_per_token(checkpoint)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "paperback-llamaserver-logs"
    logs.mkdir(exist_ok=True)
    levels = []
    for clients in args.clients:
        count = max(args.min_requests, args.requests_per_client * clients)
        requests = request_set(tokenizer, count, args.seed, args.system_tokens, args.max_prompt, args.max_output)
        context = clients * args.slot_tokens
        kv_bytes = context * kv_per_token
        caching = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
        runs = [("llama-server", None, None)] + [("paperback", kv, c) for kv in args.kv_cache_dtype for c in caching]
        for engine, kv, prefix_caching in runs:
            port = free_port()
            if engine == "llama-server":
                argv = [str(llamacpp_tools.tool("llama-server")), "-m", str(ggufs[gguf_name]), "--port", str(port),
                        "-t", str(args.threads), "-tb", str(args.threads), "-c", str(context), "-np", str(clients),
                        "--kv-unified", "--no-webui", "--alias", "model"]
            else:
                argv = [sys.executable, "-m", "paperback", "serve", str(checkpoint), "--port", str(port),
                        "--kv-cache-dtype", kv, "--kv-memory", str(kv_bytes), "--max-num-seqs", str(clients),
                        "--decode-activations", "int8", "--served-model-name", "model"]
                argv += [] if prefix_caching else ["--no-prefix-caching"]
            label = engine if kv is None else f"{engine} {kv}" + ("" if prefix_caching else ", no prefix cache")
            print(f"{clients} clients, {count} requests: {label}", flush=True)
            threads = {"OMP_NUM_THREADS": str(args.threads)}  # paperback's torch threads; llama-server takes -t
            log = logs / f"{label.replace(' ', '-').replace(',', '')}-{clients}.log"
            with Server(argv, port, log, threads) as server:
                asyncio.run(run_level(port, "model", requests[:1], 1))  # warm-up: first-call allocations
                records, wall = asyncio.run(run_level(port, "model", requests, clients))
                hits = prefix_hit_rate(port) if engine == "paperback" and prefix_caching else None
            row = {"clients": clients, "engine": engine, "kv_cache_dtype": kv or "f16", "prefix_caching": prefix_caching,
                   **summarize(records, wall), "kv_bytes": kv_bytes, "peak_rss_bytes": server.peak_rss_bytes,
                   "prefix_hit_rate": hits}
            levels.append(row)
            print(json.dumps(row), flush=True)
    warn_if_busy(args.threads)
    table = []
    for row in levels:
        peer = next(r for r in levels if r["clients"] == row["clients"] and r["engine"] == "llama-server")
        row["throughput_vs_llamaserver"] = row["output_tokens_per_s"] / peer["output_tokens_per_s"]
        def seconds(value, scale=1.0, digits=2):
            return "-" if value is None else f"{scale * value:.{digits}f}"

        table.append([str(row["clients"]), row["engine"], row["kv_cache_dtype"],
                      {True: "on", False: "off", None: "-"}[row["prefix_caching"]], f"{row['output_tokens_per_s']:.1f}",
                      f"{row['throughput_vs_llamaserver']:.2f}x", f"{row['requests_per_s']:.2f}",
                      seconds(row["ttft_p50_s"]), seconds(row["ttft_p99_s"]), seconds(row["itl_p99_s"], 1e3, 0),
                      str(row["failed"]), f"{row['peak_rss_bytes'] / 2 ** 20:.0f}",
                      f"{row['prefix_hit_rate']:.0%}" if row["prefix_hit_rate"] is not None else "-"])
    print_table(f"{args.model}: paperback serve beside llama-server, {args.threads} threads, the same W4 and KV "
                "bytes",
                ["clients", "server", "KV", "prefix cache", "output tok/s", "x", "req/s", "TTFT p50 s", "TTFT p99 s", "ITL p99 ms",
                 "failed", "peak RSS MiB", "prefix hits"], table)
    write_results(results_name(f"llamaserver_{args.model}", args.tag), {
        "model": args.model, "threads": args.threads, "llamacpp_built_for": llamacpp_tools.built_for(),
        "files": {"llama-server": str(ggufs[gguf_name]), "paperback": str(checkpoint)},
        "workload": {k: getattr(args, k) for k in ("requests_per_client", "min_requests", "system_tokens",
                                                   "max_prompt", "max_output", "slot_tokens", "seed")},
        "levels": levels})
    return 0


def kv_bytes_per_token(checkpoint: Path) -> int:
    """f16 K and V of every layer: one token state in either server's cache."""
    import torch

    from paperback.memory import dense_kv_bytes_per_token
    from paperback.quantization.checkpoint import config_from_recipe, read_recipe

    return dense_kv_bytes_per_token(config_from_recipe(read_recipe(checkpoint), checkpoint), torch.float16)


if __name__ == "__main__":
    sys.exit(main())

