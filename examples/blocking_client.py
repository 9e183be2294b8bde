"""The blocking client in five calls: put, append, peek, get, list.

    tensorshare-server --port 8000 &
    python examples/blocking_client.py --port 8000
"""
import argparse

import torch

import tensorshare


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    with tensorshare.Client(args.host, args.port, timeout=30) as client:
        state = {"weight": torch.randn(4, 3), "bias": torch.zeros(4), "step": 0}
        client.put("params", state)                      # replace the bin's items
        [params] = client.peek("params")                 # read, leave in place
        assert torch.equal(params["weight"], state["weight"])
        print("peeked params:", {k: tuple(v.shape) if torch.is_tensor(v) else v for k, v in params.items()})

        for step in range(3):                            # a queue of rollouts
            client.append("rollouts", {"obs": torch.randn(8, 4), "step": step})
        print("bins:", client.list())
        rollouts = client.get("rollouts")                # take them all, in order
        print("got", len(rollouts), "rollouts, steps", [r["step"] for r in rollouts])
        try:
            client.peek("no-such-bin")
        except tensorshare.NoSuchBinError as exc:
            print("as expected:", exc)
        client.delete("params")
        client.delete("rollouts")


if __name__ == "__main__":
    main()
