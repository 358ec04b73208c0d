"""Run a function on N real rank processes: gloo + a /dev/shm heap on the CPU (kernels under the
Triton interpreter), or NCCL + a device heap on GPUs. Used by the tests and the benchmarks.

    results = run_ranks(fn, world_size=2, args=(...), heap_size=1 << 20)

`fn(ctx, *args)` runs on every rank; its return values come back as a list indexed by rank. The
first rank to fail raises RankFailedError here with its rank and traceback; a rank that dies
without a word, or a run past `timeout`, kills every rank. A test that kills a rank on purpose
names it in `may_exit`: its exit without a result is then its result, a RankExited. `fn` may live
in a test file that is not importable by module name: the children load it from its file.

Rank processes are forked from a fork server that has imported torch once (each spawned
process paid about 2.5 CPU-seconds for them, most of a small test's time on CI's 2 cores). Every call
still gets fresh processes, so no state (stats counters, registered ops, Triton's interpreter, a heap
a killed peer left behind) carries from one call to the next. Triton and the kernels load in the
child, after its environment is set.

`share_gpus=True` (default: TP_OVERLAP_SHARE_GPUS=1 in the environment) lets more ranks than GPUs
run, rank r on GPU r % count: a check of the protocol at a world size the machine cannot hold one
rank per GPU (TP=4 on two GPUs). Ranks on one
GPU are time-sliced, so it is for correctness, never for timing; NCCL refuses two ranks on a GPU, so
the device group is gloo, and the heap uses the ipc backend (one allocation per process, opened by
the other processes of the same GPU as well as the peers').
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
import inspect
import os
import pickle
import queue as queue_mod
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tp_overlap_plugin import options

# Multicast on NVLink can take a shared host's GPUs out of service; never turn it on.
_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# What the fork server imports once for all ranks: the costly part of a rank's start. Not Triton: its
# own `triton.jit` functions (tl.cdiv, ...) are built for the interpreter or the compiler as it is
# imported, by TRITON_INTERPRET, which differs between a CPU and a GPU call of one process. Nothing
# here touches a GPU (a forked child could not use it).
_PRELOAD = ["__main__", "torch", "torch.distributed", "torch.multiprocessing"]


class RankFailedError(RuntimeError):
    def __init__(self, rank: int, detail: str):
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank
        self.detail = detail


@dataclass(frozen=True)
class RankExited:
    """The result of a rank in `may_exit` that exited without returning one."""
    exitcode: int


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup            # gloo, CPU: heap rendezvous and host-side exchanges
    device_group: dist.ProcessGroup     # NCCL/RCCL on GPUs; gloo on the CPU and when ranks share GPUs
    heap: object | None = None          # SymmetricHeap when run_ranks got a heap_size
    extras: dict = field(default_factory=dict)


@dataclass(frozen=True)
class _FnRef:
    module: str
    qualname: str
    file: str

    @classmethod
    def of(cls, fn) -> "_FnRef":
        module = fn.__module__
        spec = getattr(sys.modules.get(module), "__spec__", None)
        if module == "__main__" and spec is not None:
            module = spec.name  # `python -m pkg.mod`: the fork server did not import it; the ranks do, by name
        return cls(module, fn.__qualname__, inspect.getfile(fn))

    def resolve(self):
        try:
            mod = importlib.import_module(self.module)   # a script's __main__: the fork server imported it
        except ImportError:
            name = "_tp_overlap_rankfn_" + os.path.splitext(os.path.basename(self.file))[0]
            mod = sys.modules.get(name)
            if mod is None:
                spec = importlib.util.spec_from_file_location(name, self.file)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
        obj = mod
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return obj


def run_ranks(fn, world_size: int, args: tuple = (), *, device: str = "cpu", heap_size: int | None = None,
              heap_kwargs: dict | None = None, timeout: float = 120.0, env: dict | None = None,
              may_exit=(), share_gpus: bool | None = None) -> list:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    may_exit = set(may_exit)
    if device == "cuda" and torch.cuda.device_count() == 0:
        raise RuntimeError("run_ranks(device='cuda') found no GPU")
    if share_gpus is None:
        share_gpus = sharing_gpus()
    shared = device == "cuda" and torch.cuda.device_count() < world_size
    if shared and not share_gpus:
        raise RuntimeError(f"run_ranks needs {world_size} GPUs, found {torch.cuda.device_count()} "
                           f"(share_gpus=True runs several ranks per GPU, for correctness checks only)")
    child_env = dict(env or {})
    if shared:
        child_env.setdefault("TP_OVERLAP_HEAP_BACKEND", "ipc")
    if device == "cpu":
        child_env.setdefault("TRITON_INTERPRET", "1")
    else:
        for k, v in _GPU_ENV.items():
            child_env.setdefault(k, v)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)   # read when the server starts: the first call of this process
    results_q = ctx.Queue()
    store_file = tempfile.NamedTemporaryFile(prefix="tp_overlap_store_", delete=False)
    store_file.close()
    os.unlink(store_file.name)  # FileStore creates it; it must not exist yet
    fnref = _FnRef.of(fn)
    procs = []
    with _patched_environ(child_env):
        # A forked child inherits the fork server's environment, the one of the call that started it
        # (which a script's __main__, imported there, saw too); it takes this call's, as a spawned one would.
        where = _Where(dict(os.environ), os.getcwd(), list(sys.path))
        for rank in range(world_size):
            p = ctx.Process(target=_rank_main, daemon=True,
                            args=(fnref, where, rank, world_size, store_file.name, device, heap_size,
                                  heap_kwargs or {}, args, results_q, timeout, shared))
            p.start()
            procs.append(p)
    results: dict[int, object] = {}
    failure: tuple[int, str] | None = None
    deadline = time.monotonic() + timeout
    exited: dict[int, float] = {}
    try:
        while len(results) < world_size and failure is None:
            try:
                kind, rank, payload = results_q.get(timeout=0.2)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(results))
                    failure = (missing[0], f"timed out after {timeout:.0f} s; ranks {missing} "
                                           f"never finished (killed)")
                    break
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        # give its last message time to arrive before calling it a silent death
                        first_seen = exited.setdefault(r, time.monotonic())
                        if time.monotonic() - first_seen > 2.0:
                            if r in may_exit:
                                results[r] = RankExited(p.exitcode)
                                continue
                            failure = (r, f"process exited with code {p.exitcode} without a result")
                            break
                continue
            if kind == "ok":
                results[rank] = pickle.loads(payload)
            else:
                failure = (rank, payload)
    finally:
        # ranks that died on their own are often the root cause of another rank's error
        died = [(r, p.exitcode) for r, p in enumerate(procs)
                if p.exitcode not in (None, 0) and (failure is None or r != failure[0])]
        for p in procs:
            if p.is_alive():
                p.join(timeout=0.5 if failure is None else 0.0)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        from tp_overlap_plugin.heap_shm import remove_stale_shm
        remove_stale_shm(p.pid for p in procs)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(store_file.name)
        results_q.close()
    if failure is not None:
        rank, detail = failure
        for r, code in died:
            detail += f"\n(rank {r} had exited with code {code})"
        raise RankFailedError(rank, detail)
    return [results[r] for r in range(world_size)]


def sharing_gpus() -> bool:
    """Whether GPU runs may put several ranks on a GPU (TP_OVERLAP_SHARE_GPUS=1): the GPU tests then
    run their 4- and 8-rank cases on a 2-GPU machine."""
    return options.env_share_gpus()


def gpu_ranks_fit(world_size: int) -> bool:
    """Whether run_ranks(device="cuda") can start this many ranks here (a GPU test skips if not)."""
    have = torch.cuda.device_count()
    return have >= world_size or (have > 0 and sharing_gpus())


@contextlib.contextmanager
def _patched_environ(env: dict):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class _Where:
    """The caller's environment, working directory and import path, which its ranks run in."""
    environ: dict
    cwd: str
    path: list

    def enter(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.path


def _rank_main(fnref, where, rank, world_size, store_path, device, heap_size, heap_kwargs, args, results_q,
               timeout, shared):
    heap = None
    try:
        where.enter()
        store = dist.FileStore(store_path, world_size)
        td = datetime.timedelta(seconds=max(timeout, 10))
        if device == "cpu":
            dev = torch.device("cpu")
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=td)
            group = device_group = dist.group.WORLD
        else:
            dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(dev)
            if shared:
                dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=td)
                group = device_group = dist.group.WORLD
            else:
                dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, timeout=td,
                                        device_id=dev)
                device_group = dist.group.WORLD
                group = dist.new_group(backend="gloo", timeout=td)
        ctx = RankContext(rank, world_size, dev, group, device_group)
        if heap_size is not None:
            from tp_overlap_plugin.heap import SymmetricHeap
            heap = SymmetricHeap(group, dev, heap_size, **heap_kwargs)
            ctx.heap = heap
        result = fnref.resolve()(ctx, *args)
        # plain pickle: the queue's own pickler would pass tensors as shared-memory handles,
        # which die with this process
        results_q.put(("ok", rank, pickle.dumps(result)))
    except BaseException:
        results_q.put(("err", rank, traceback.format_exc()))
    finally:
        if heap is not None:
            with contextlib.suppress(Exception):
                heap.close()
        # skip destroy_process_group: it can block on a peer that died; the process exits anyway
        from tp_overlap_plugin.heap_shm import _unlink_all
        _unlink_all()  # os._exit skips atexit
        with contextlib.suppress(Exception):
            results_q.close()
            results_q.join_thread()
        os._exit(0)


def agree(ctx, value):
    """Rank 0's value on every rank (todo lists and the budget's go/stop must be alike everywhere)."""
    box = [value]
    dist.broadcast_object_list(box, src=0, group=ctx.group)
    return box[0]
