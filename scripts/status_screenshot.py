#!/usr/bin/env python3
"""Render the status page of a busy server in headless Chromium: docs/status-page.png.

    .venv/bin/python scripts/status_screenshot.py [--seconds 20] [--out docs/status-page.png]

Starts a server with ``--metrics-port`` and a small memory limit, runs an RL-like
load for a while (a trainer publishing versions, three workers reading them and
appending rollouts, one lagging; a large bin that spills), then screenshots ``/``.
Needs ``chromium`` (or ``chromium-browser``/``google-chrome``) on the PATH.
"""

from __future__ import annotations

import argparse
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(url: str, out: Path, size: str = "1280,1500", timeout: float = 60) -> None:
    """Screenshot ``url`` with headless Chromium into ``out`` (a PNG)."""
    exe = browser()
    if exe is None:
        raise SystemExit("no chromium on the PATH (apt-get install chromium)")
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={size}", f"--screenshot={out}", url], check=True, capture_output=True,
                   timeout=timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "status-page.png")
    args = parser.parse_args()
    import torch

    import tensorshare

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "tensorshare_server", "--port", "0", "--metrics-port",
                               str(metrics_port), "--memory-limit", "64MiB"], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        port = int(re.search(r":(\d+)$", server.stdout.readline().strip()).group(1))
        stop = threading.Event()

        def trainer():
            with tensorshare.Client("127.0.0.1", port) as c:
                version = 0
                while not stop.is_set():
                    c.put("cartpole/parameters", {"version": version, "w": torch.randn(256, 256)}, tag=version)
                    c.get("cartpole/rollouts") if "cartpole/rollouts" in c.list() else None
                    version += 1
                    time.sleep(0.5)

        def worker(lag: int):
            with tensorshare.Client("127.0.0.1", port, zero_copy=False) as c:
                while not stop.is_set():
                    try:
                        [item] = c.peek("cartpole/parameters")
                    except tensorshare.NoSuchBinError:
                        time.sleep(0.1)
                        continue
                    version = max(item["version"] - lag, 0)
                    for _ in range(5):
                        c.append("cartpole/rollouts", {"version": version, "obs": torch.randn(32, 512)}, tag=version)
                    time.sleep(0.2)

        def learner():  # a replay table: an actor inserts, a learner samples
            with tensorshare.Client("127.0.0.1", port) as c:
                c.create_table("cartpole/replay", 50_000, {"obs": ((4,), torch.float32), "reward": ((), torch.float32)},
                               min_size_to_sample=64)
                while not stop.is_set():
                    c.insert("cartpole/replay", {"obs": torch.randn(64, 4), "reward": torch.rand(64)})
                    c.sample("cartpole/replay", 256)
                    time.sleep(0.05)

        with tensorshare.Client("127.0.0.1", port) as c:
            for i in range(6):
                c.append("replay/buffer", torch.randn(4 << 20))  # 16 MiB each: past the limit, some spill
            c.put("eval/scores", torch.arange(100.0))
        threads = [threading.Thread(target=trainer), threading.Thread(target=learner)] + \
            [threading.Thread(target=worker, args=(lag,)) for lag in (0, 0, 2)]
        for t in threads:
            t.start()
        time.sleep(args.seconds)
        screenshot(f"http://127.0.0.1:{metrics_port}/", args.out)
        stop.set()
        for t in threads:
            t.join(30)
        print(f"wrote {args.out}")
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    main()
