"""Learner failover: checkpoint into the server, kill the learner, resume; workers never restart.

    python examples/rl_failover.py [--workers 2]

Starts ``tensorshare-server --data-dir`` (a temporary directory), workers and a
learner that stores its policy and optimizer state in the server every 5
versions.  At version 12 the learner is killed with SIGKILL; a new learner
process resumes from the checkpoint, continues the version numbers the server
holds, and trains to version 30 with the same worker processes, which never
noticed.
"""

import argparse
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from launch import server_and_processes

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as data, \
            server_and_processes("--data-dir", data, announce=False) as (port, procs):
        common = ["--port", str(port), "--experiment", "failover"]
        workers = [subprocess.Popen([sys.executable, str(HERE / "rl_worker.py"), *common, "--seed", str(seed)])
                   for seed in range(args.workers)]
        procs += workers
        learner = [sys.executable, str(HERE / "rl_trainer.py"), *common, "--batch", "16",
                   "--checkpoint-every", "5"]
        first = subprocess.Popen([*learner, "--versions", "1000", "--no-stop"], stdout=subprocess.PIPE,
                                 text=True)
        procs.append(first)
        for line in first.stdout:
            print(f"[learner 1] {line.rstrip()}", flush=True)
            if line.startswith("version  12"):
                first.send_signal(signal.SIGKILL)
                break
        first.wait(30)
        print("[learner 1] killed with SIGKILL; starting learner 2", flush=True)
        second = subprocess.Popen([*learner, "--versions", "30", "--resume"], stdout=subprocess.PIPE,
                                  text=True)
        procs.append(second)
        for line in second.stdout:
            print(f"[learner 2] {line.rstrip()}", flush=True)
        code = second.wait(300)
        for worker in workers:  # the same processes all along; the learner asked them to stop
            worker.wait(30)
        print(f"workers stopped, never restarted: exit codes {[w.returncode for w in workers]}", flush=True)
        return code


if __name__ == "__main__":
    sys.exit(main())
