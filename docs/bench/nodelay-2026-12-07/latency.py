"""Latency of keep-alive requests to a running `dartspec serve` (one client, the openai package's transport, httpx):
GET /health, a 1-token completion, and a streamed 64-token completion's time to the end and its largest gap between
chunks. Run against the build before and after the TCP_NODELAY fix (alternating), same machine, same model."""

import json
import statistics
import sys
import time

import httpx

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8011"


def median_ms(fn, n: int = 30) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    client = httpx.Client(timeout=120)
    client.get(URL + "/health")
    ids = list(range(1000, 1016))
    one = {"prompt": ids, "max_tokens": 1, "temperature": 0}
    print(f"GET /health: {median_ms(lambda: client.get(URL + '/health')):.1f} ms")
    print(f"1-token completion: {median_ms(lambda: client.post(URL + '/v1/completions', json=one)):.1f} ms")
    body = {"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True}
    totals, gaps = [], []
    for _ in range(5):
        start = last = time.perf_counter()
        biggest = 0.0
        with client.stream("POST", URL + "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    biggest = max(biggest, now - last)
                    last = now
                    json.loads(line[6:])
        totals.append(time.perf_counter() - start)
        gaps.append(biggest)
    total, gap = statistics.median(totals) * 1000, statistics.median(gaps) * 1000
    print(f"streamed 64 tokens: {total:.0f} ms, largest gap {gap:.0f} ms")


if __name__ == "__main__":
    main()
