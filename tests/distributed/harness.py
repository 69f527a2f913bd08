"""Run a function on 2 CPU ranks (gloo), each its own process, with a deadline.

`run_ranks(worker, *args)` starts the ranks with torch.multiprocessing, waits for
them until a deadline, and returns each rank's result. gloo ranks are forked from a
fork server that has imported torch, graphopt and Inductor once per test process
(spawned, each rank spent most of its CPU importing them again); nccl ranks are
spawned, as CUDA wants. A rank that raises, dies or
is still running at the deadline (then killed) makes it raise `RanksFailed`, naming
every rank's outcome: a test never hangs, whatever a rank does. When one rank
fails, the others fail too at their next collective, within `collective_timeout`. `worker(rank, world, *args)`
must be a module-level function (the spawned processes import it by name).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import socket
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    def __init__(self, outcomes: list[str]):
        super().__init__("; ".join(f"rank {rank}: {outcome}" for rank, outcome in enumerate(outcomes)))
        self.outcomes = outcomes


def run_ranks(worker: Callable, *args: Any, world: int = 2, timeout: float = 100.0,
              collective_timeout: float = 60.0, backend: str = "gloo") -> list[Any]:
    """`worker(rank, world, *args)` on `world` ranks of a `backend` process group
    (with "nccl", rank i uses cuda:i); their results, by rank."""
    method = "forkserver" if backend == "gloo" else "spawn"
    if method == "forkserver":
        # Read when the fork server starts (the first gloo test of this process); a rank
        # imports whatever else its worker needs after the fork.
        multiprocessing.set_forkserver_preload(["torch", "torch._inductor.compile_fx", "graphopt", worker.__module__])
    with tempfile.TemporaryDirectory() as out:
        # The environment as it is now, not as it was when the fork server started.
        context = mp.start_processes(_entry, args=(worker, world, _free_port(), out, collective_timeout, backend, args,
                                                   dict(os.environ)),
                                     nprocs=world, join=False, start_method=method)
        # Not context.join(): it stops every rank as soon as one fails, and the
        # test wants to see what the others do then (raise, or wait forever).
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in context.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        killed = [p.is_alive() for p in context.processes]
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
        outcomes = [_outcome(out, rank, p.exitcode, timeout if k else None)
                    for rank, (p, k) in enumerate(zip(context.processes, killed))]
    if any(not isinstance(o, dict) for o in outcomes):
        raise RanksFailed([o if isinstance(o, str) else "finished" for o in outcomes])
    return [o["result"] for o in outcomes]


def _entry(rank: int, worker: Callable, world: int, port: int, out: str, collective_timeout: float,
           backend: str, args: tuple, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    # Each test compiles afresh (test_compile_cache.py turns the compile cache on for itself).
    os.environ["GRAPHOPT_CACHE_DIR"] = ""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        torch.save({"result": worker(rank, world, *args)}, os.path.join(out, f"{rank}.pt"))
    except BaseException as error:
        torch.save(f"raised {type(error).__name__}: {error}", os.path.join(out, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def _outcome(out: str, rank: int, exitcode: int | None, killed_at: float | None) -> dict | str:
    """{"result": ...}, or what went wrong in words."""
    path = os.path.join(out, f"{rank}.pt")
    if killed_at is not None:
        return f"still running at the {killed_at:.0f} s deadline: killed"
    if not os.path.exists(path):
        return f"exited with code {exitcode} without a result"
    return torch.load(path, weights_only=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
