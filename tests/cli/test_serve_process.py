"""`paperback serve` as a user runs it: a process that answers, then on SIGTERM finishes and reports what it freed."""

import signal
import socket
import subprocess
import sys
import time

import httpx


def test_serve_answers_then_shuts_down_cleanly_on_sigterm(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "paperback", "serve", "smollm2", "--port", str(port),
                                 "--kv-cache-dtype", "int8", "--kv-memory", str(64 * 2 ** 20)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    text = log.read_text()
    assert "shut down: 0 open requests failed; every KV block free, every staging slot free" in text
    assert "Traceback" not in text
