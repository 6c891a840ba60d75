"""Two gloo ranks end as a finished multi-rank run does: a last broadcast, the group still referenced (as the
trainer's modules hold it), then the ending under test and interpreter exit.

    python tests/distributed/exit_race.py close_process_group   # ours; exits 1 if either rank aborts
    python tests/distributed/exit_race.py destroy_only          # bare destroy_process_group: aborted 4 runs in 20 here
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

# The CLI's own ending, loaded alone: importing the package (Lightning, transformers) would take most of a run.
_SOURCE = Path(__file__).resolve().parents[2] / "gspo_lightning" / "process_group.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


KEPT = []  # lives until the interpreter finalises, as the CLI (held by jsonargparse) and its modules do


def run_rank(rank: int, ending: str) -> None:
    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("process_group", _SOURCE)
    process_group = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(process_group)
    sys.setswitchinterval(30)  # the main thread keeps the GIL unless it blocks: the race shows often
    dist.init_process_group("gloo", rank=rank, world_size=2)
    KEPT.append(dist.group.WORLD)
    for _ in range(3):
        dist.broadcast_object_list([os.getcwd() if rank == 0 else None])  # Python-owned tensors in the work
    if ending == "close_process_group":
        process_group.close_process_group()
    else:
        dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("ending", choices=["close_process_group", "destroy_only"])
    parser.add_argument("--rank", type=int, default=None)
    args = parser.parse_args()
    if args.rank is not None:
        run_rank(args.rank, args.ending)
        return 0
    environment = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    command = [sys.executable, __file__, args.ending, "--rank"]
    ranks = [subprocess.Popen(command + [str(rank)], env=environment) for rank in (0, 1)]
    codes = [rank.wait(timeout=120) for rank in ranks]
    print("exit codes", codes)
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
