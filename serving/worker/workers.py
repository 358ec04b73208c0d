"""The engine's ranks: one process per rank, each with a `ModelRunner` (runner.py).

Process model: the process that builds the engine is rank 0. With tensor_parallel_size > 1 it spawns
the other ranks itself (`spawn` start method, a gloo/NCCL group over a local TCP port), unless
torch.distributed is already initialised or RANK/WORLD_SIZE are set (torchrun, or a test harness):
then every rank constructs the engine, and ranks > 0 serve rank 0's steps (`worker_loop`) until rank 0
shuts down (`is_driver` is False there).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config import EngineConfig, env_rank_world
from .distributed import destroy_group_bounded, init_distributed, rank_device
from .layer_factory import make_overlap_plan
from .runner import ModelRunner


class Workers:
    """This process's rank and runner, and on rank 0 the rank processes it spawned."""

    def __init__(self, cfg: EngineConfig):
        self.procs: list = []          # the spawned ranks 1..W-1 (none under torchrun)
        self.errq = None               # what they report before failing
        self.owns_group = False
        self.is_driver = True
        world = cfg.tensor_parallel_size
        launched = env_rank_world()
        if dist.is_initialized() or launched:
            rank = dist.get_rank() if dist.is_initialized() else launched[0]
            world_env = dist.get_world_size() if dist.is_initialized() else launched[1]
            if world_env != world:
                raise ValueError(f"launched with {world_env} ranks but tensor_parallel_size={world}")
            self.owns_group = not dist.is_initialized()
            local = launched[2] if launched else None
            # the plan before the group, as rank 0's before the spawn below: a refusal leaves no peer waiting
            plan = make_overlap_plan(cfg, rank_device(cfg, rank, world, local), world)
            device, group, ctrl = init_distributed(cfg, rank, world, None, local)
            self.runner = ModelRunner(cfg, rank, world, group, ctrl, device, plan)
            self.is_driver = rank == 0
        elif world > 1:
            self._spawn_and_join(cfg, world)
        else:
            device, group, ctrl = init_distributed(cfg, 0, 1, None)
            self.runner = ModelRunner(cfg, 0, 1, group, ctrl, device, make_overlap_plan(cfg, device, 1))

    def _spawn_and_join(self, cfg: EngineConfig, world: int) -> None:
        # rank 0's plan before any rank starts: a process that cannot run the flag's kernels refuses here
        plan = make_overlap_plan(cfg, rank_device(cfg, 0, world), world)
        ctx = mp.get_context("spawn")
        host, port = "127.0.0.1", _free_port()
        self.errq = ctx.Queue()
        store = dist.TCPStore(host, port, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=cfg.dist_timeout_s))
        for r in range(1, world):
            # the config as this process received it: spawn pickles it, with nothing to parse again
            p = ctx.Process(target=worker_main, args=(cfg, r, world, host, port, self.errq), daemon=True)
            p.start()
            self.procs.append(p)
        try:
            deadline = time.monotonic() + cfg.dist_timeout_s
            pending = [f"worker_ready/{r}" for r in range(1, world)]
            while not store.check(pending):
                dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"worker rank(s) {dead} exited during start-up (a script that starts a TP "
                                       f"engine needs an `if __name__ == '__main__':` guard: spawned workers "
                                       f"re-import the main module)")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not start within dist_timeout_s={cfg.dist_timeout_s}")
                time.sleep(0.05)
            device, group, ctrl = init_distributed(cfg, 0, world, store)
            self.owns_group = True
            self.runner = ModelRunner(cfg, 0, world, group, ctrl, device, plan)
        except BaseException as e:
            msg = self.errors()
            self._kill()
            if dist.is_initialized() and self.owns_group:
                destroy_group_bounded()
            raise RuntimeError(f"engine start failed: {e}" + (f"; workers: {msg}" if msg else "")) from e

    def errors(self) -> str:
        """What the spawned ranks reported before failing, and which of them are gone and how: a rank
        killed by a signal reports nothing itself, and rank 0's own error (a closed socket, a wait that
        gave up) may not say which rank it lost. Empty when nothing is known."""
        if not self.procs:
            return ""
        time.sleep(0.2)
        errs = []
        while not self.errq.empty():
            errs.append(self.errq.get_nowait())
        for rank, p in enumerate(self.procs, start=1):
            code = p.exitcode
            if code is not None and code < 0:
                errs.append(f"rank {rank} was killed by {signal.Signals(-code).name}")
            elif code is not None:
                errs.append(f"rank {rank} exited with code {code}")
            elif stopped(p.pid):
                errs.append(f"rank {rank} (pid {p.pid}) is stopped (SIGSTOP or a debugger)")
        return "; ".join(errs)

    def _kill(self) -> None:
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.procs = []

    def shutdown(self, stop_workers: bool) -> None:
        """Tell the ranks to stop (unless `stop_workers` is False: a broken group cannot be told), drop
        this rank's KV cache and graphs, leave the group, reap the spawned ranks."""
        runner = getattr(self, "runner", None)
        try:
            if stop_workers and self.is_driver and runner is not None and runner.world_size > 1:
                runner.stop_workers()
        except Exception:
            pass   # a dead worker cannot be told to stop; it is killed below
        finally:
            # Graphs hold NCCL work: drop them before the communicator, then leave the group while
            # the workers leave theirs (see destroy_group_bounded), and only then reap them.
            if runner is not None:
                runner.release()
            if self.owns_group and dist.is_initialized():
                destroy_group_bounded()
            self._kill()


def worker_main(cfg: EngineConfig, rank: int, world_size: int, host: str, port: int, err_queue=None) -> None:
    """Entry point of a spawned worker rank: build the runner, then serve steps until told to stop."""
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=timedelta(seconds=cfg.dist_timeout_s))
        # Rank 0 waits for this key while watching our pid, so a worker that dies before this point
        # (bad import, bad config) is reported instead of leaving rank 0 waiting in a rendezvous.
        store.set(f"worker_ready/{rank}", "1")
        device, group, ctrl = init_distributed(cfg, rank, world_size, store)
        runner = ModelRunner(cfg, rank, world_size, group, ctrl, device, make_overlap_plan(cfg, device, world_size))
        runner.worker_loop()
        runner.release()  # graphs hold NCCL work: gone before the communicator is
    except BaseException as e:  # surfaced to rank 0, which would otherwise only see a closed socket
        if err_queue is not None:
            err_queue.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise
    finally:
        if dist.is_initialized():
            destroy_group_bounded()


def stopped(pid: int) -> bool:
    """Whether a live process is stopped (state T or t in /proc; False where there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
