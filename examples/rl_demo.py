"""The whole RL setup in one command: a server, a trainer and N workers, as processes.

    python examples/rl_demo.py [--workers 4] [--versions 40]

Starts ``tensorshare-server`` on a free port, the trainer and the workers, prints
the trainer's progress, then stops everything.
"""

import argparse
import subprocess
import sys
from pathlib import Path

from launch import server_and_processes

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--versions", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    with server_and_processes() as (port, procs):
        common = ["--port", str(port), "--experiment", "corridor"]
        trainer = subprocess.Popen([sys.executable, str(HERE / "rl_trainer.py"), *common,
                                    "--versions", str(args.versions), "--batch", str(args.batch)])
        procs.append(trainer)
        for seed in range(args.workers):
            procs.append(subprocess.Popen([sys.executable, str(HERE / "rl_worker.py"), *common, "--seed", str(seed)]))
        print(f"trainer and {args.workers} workers started", flush=True)
        code = trainer.wait(timeout=900)
        for worker in procs[2:]:  # the trainer asked them to stop
            worker.wait(timeout=30)
        print("workers stopped", flush=True)
        return code

if __name__ == "__main__":
    sys.exit(main())
