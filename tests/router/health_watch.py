"""``python -m tests.router.health_watch URL PID``: ``GET URL/health`` every 20 ms, noting each one's
seconds and process PID's RSS, until its standard input closes; then prints them as one JSON
object. A process of its own, so what the test process does meanwhile (sending 100 MB) cannot
slow the measurement."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def main() -> None:
    url, pid = urlsplit(sys.argv[1]), int(sys.argv[2])
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    latencies: list[float] = []
    rss: list[float] = []
    statuses: list[int] = []
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    while not done.is_set():
        started = time.monotonic()
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        latencies.append(time.monotonic() - started)
        statuses.append(response.status)
        rss.append(rss_mb(pid))
        time.sleep(0.02)
    connection.close()
    print(json.dumps({"latencies": latencies, "rss": rss, "statuses": statuses}))


if __name__ == "__main__":
    main()
