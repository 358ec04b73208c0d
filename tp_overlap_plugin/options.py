"""The `tp_overlap` options: one set for both engine adapters.

Our engine reads them from `EngineConfig.tp_overlap` (its pydantic model wraps this dataclass: the
fields and their checks are this file's), from `--tp-overlap` / `--tp-overlap-config`, or from the
environment; vLLM from `--additional-config '{"tp_overlap": {...}}'` or the environment
(vllm_plugin.parse_options).

The environment, read alike by both: TP_OVERLAP unset, or 0 / false / off / no: off; 1 / true / on /
yes: on with the defaults; a JSON object: on with those options. `true` / `false` in place of the
object mean the same wherever they are written: `TPOverlapOptions.from_section` is their one reader.

Each rank of either adapter turns the options into one `OverlapPlan` (overlap_plan.py): the table, the
design, the limits, resolved once; the layers, the model runner and the piecewise graphs take the plan.

Every environment variable the package reads is read here, each by one function at the end of this
file (integration_tests/test_code_layout.py checks that no other module reads one), so that one file
lists them all.

Plain Python, no Triton and no pydantic: vLLM's front end reads the options before anything decides
whether Triton runs interpreted, and the plugin needs only torch and Triton.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, Literal, Optional

ENV_SWITCH = "TP_OVERLAP"
# How the dispatcher picks a path (tp_overlap_plugin/dispatch.py): the measured table, always our
# kernels, never them
DISPATCH_MODES = ("table", "overlap", "stock")
CONFIG_KEY = "tp_overlap"
BACKENDS = ("torch", "ipc", "shm")
# The sequence-parallel layout's AG-GEMM / GEMM-RS designs (DESIGN.md; ops/ag_gemm.py and gemm_rs.py: one
# launch each; ops/chunked.py: the vendor GEMM per peer's block, the copy engine pulling), and the option
# that picks one: "auto", the design the dispatch table's verdict chose (tune measures both)
DESIGNS = ("kernel", "chunked")
FUSED_OPS = ("auto", *DESIGNS)
# The all-reduce's capacity: larger messages take the stock all-reduce.
DEFAULT_MAX_BYTES = 8 << 20
# The heap's own control block (error slot, host-barrier flags), with room to spare.
CONTROL_BYTES = 64 << 10
MIN_HEAP_SIZE = 1 << 20
# kernels/all_reduce.py's CHUNK_BYTES and ops/all_reduce.py's DEFAULT_ONE_SHOT_BYTES, restated so that
# sizing the heap does not import (and so define) the kernels before the Triton interpreter check;
# test_vllm_plugin.py checks they agree, and that the size covers HeapAllReduce.heap_bytes.
_AR_CHUNK_BYTES = 8192
_AR_ONE_SHOT_BYTES = 1 << 20
_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def _option(default, help: str):
    """A field with its one description, which --help prints (tp_overlap_plugin/cli/engine_args.py)."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclasses.dataclass(frozen=True)
class TPOverlapOptions:
    """What the flag does, where it is on. Every field means the same in both adapters."""

    # pydantic (the engine's config) validates this dataclass; unknown keys are errors there too
    __pydantic_config__ = {"extra": "forbid"}

    enabled: bool = True
    heap_size: Optional[int] = _option(None, "symmetric heap bytes per rank; default: what the layers allocate "
                                             "(heap_bytes)")
    heap_timeout_s: Optional[float] = _option(None, "seconds a kernel waits on a peer before it gives up and the "
                                                    "step fails; default TP_OVERLAP_HEAP_TIMEOUT_S or 60")
    dispatch: Literal["table", "overlap", "stock"] = _option(
        "table", "table: the measured choice per op and size for this device and TP size (stock where "
                 "unmeasured); overlap: always our kernels; stock: never")
    dispatch_table: Optional[str] = _option(None, "a dispatch table JSON to use instead of the cached or shipped one")
    backend: Optional[Literal["torch", "ipc", "shm"]] = _option(
        None, "the heap backend; default per device: torch on CUDA, ipc on ROCm, shm on the CPU")
    fused_ops: Literal["auto", "kernel", "chunked"] = _option(
        "auto", "the sequence-parallel layout's fused AG-GEMM / GEMM-RS: auto: the design the dispatch table's "
                "verdict chose (`tp-overlap tune` measures both in the engine); kernel: one Triton launch each, "
                "GEMM and pushes in it; chunked: the vendor GEMM per peer's block, the copy engine pulling the "
                "blocks beside it, its prefill step sizes in CUDA graphs (ops/chunked.py). An explicit design "
                "the table did not choose runs without the table's fused-op rows and verdict (replicated layout)")
    max_bytes: int = _option(DEFAULT_MAX_BYTES, "the largest message our all-reduce takes; larger ones take the "
                                                "stock all-reduce")

    def __post_init__(self):
        def bad(name: str, rule: str):
            return ValueError(f"{CONFIG_KEY}.{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.enabled, bool):
            raise bad("enabled", "true or false")
        if self.heap_size is not None and (not _is_int(self.heap_size) or self.heap_size < MIN_HEAP_SIZE):
            raise bad("heap_size", f"an integer number of bytes of at least {MIN_HEAP_SIZE} (1 MiB)")
        if self.heap_timeout_s is not None and (not isinstance(self.heap_timeout_s, (int, float))
                                                or not 0 < self.heap_timeout_s < 1e9):
            raise bad("heap_timeout_s", "a positive number of seconds")
        if self.dispatch not in DISPATCH_MODES:
            raise bad("dispatch", f"one of {DISPATCH_MODES}")
        if self.dispatch_table is not None and not isinstance(self.dispatch_table, str):
            raise bad("dispatch_table", "a path")
        if self.backend is not None and self.backend not in BACKENDS:
            raise bad("backend", f"one of {BACKENDS}")
        if self.fused_ops not in FUSED_OPS:
            raise bad("fused_ops", f"one of {FUSED_OPS}")
        if not _is_int(self.max_bytes) or self.max_bytes <= 0:
            raise bad("max_bytes", "a positive integer")

    @classmethod
    def from_section(cls, section: Any, where: str) -> Optional["TPOverlapOptions"]:
        """Options from a config section: an object of options, true / false, or None (absent).
        None when the section is absent or turns the flag off; `where` names the section in errors."""
        if section is None:
            return None
        if isinstance(section, bool):
            section = {"enabled": section}
        if not isinstance(section, dict):
            raise ValueError(f"{where} must be an object, e.g. '{{\"{CONFIG_KEY}\": {{}}}}', got {section!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(section) - set(known))
        if unknown:
            raise ValueError(f"{where}: unknown option(s) {unknown}; known: {sorted(known)}")
        opts = cls(**section)
        return opts if opts.enabled else None

    def heap_bytes(self, need: int) -> int:
        """The heap per rank: heap_size when set, else `need` (what the layers will allocate) and the
        control block, in whole MiB. Rounded up to the heap's 256-byte alignment either way."""
        if self.heap_size is not None:
            return -(-self.heap_size // 256) * 256
        return -(-(need + CONTROL_BYTES) // (1 << 20)) * (1 << 20)

    def all_reduce_heap_bytes(self, world: int) -> int:
        """The heap of vLLM's layer swap, which holds the all-reduce's buffers only (HeapAllReduce:
        one-shot receive slots 2 x W x one-shot capacity, two-shot scatter slots 2 x W x the chunks
        each rank owns, gather slots 2 x max_bytes, an epoch per chunk, alignment)."""
        cb, w = _AR_CHUNK_BYTES, world
        max_bytes = -(-self.max_bytes // cb) * cb
        one_shot = -(-min(_AR_ONE_SHOT_BYTES, max_bytes) // cb) * cb
        need = (2 * w * one_shot + 2 * w * -(-(max_bytes // cb) // w) * cb + 2 * max_bytes
                + 8 * (one_shot + max_bytes) // cb + 5 * 256)
        return self.heap_bytes(need)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def env_switch() -> bool | dict | None:
    """TP_OVERLAP: None (unset), False (off), True (on) or a dict (on, with those options)."""
    raw = os.environ.get(ENV_SWITCH, "").strip()
    if raw == "":
        return None
    if raw.lower() in _ON:
        return True
    if raw.lower() in _OFF:
        return False
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise ValueError(f"{ENV_SWITCH}={raw!r}: use 1 (on), 0 (off) or a JSON object of options")
    return value


def options_from_env() -> Optional[TPOverlapOptions]:
    """The options the environment sets; None when it leaves the flag off."""
    env = env_switch()
    return None if env is None else TPOverlapOptions.from_section(env, ENV_SWITCH)


# ---- the environment: every variable the package reads ----------------------------------------------

def env_heap_backend() -> Optional[str]:
    """TP_OVERLAP_HEAP_BACKEND: the heap backend (torch, ipc, shm) instead of the device's default."""
    return os.environ.get("TP_OVERLAP_HEAP_BACKEND") or None


def env_heap_size() -> Optional[int]:
    """TP_OVERLAP_HEAP_SIZE: symmetric heap bytes per rank (SymmetricHeap's default size)."""
    raw = os.environ.get("TP_OVERLAP_HEAP_SIZE")
    return int(raw) if raw is not None else None


def env_heap_timeout_s(setting: str) -> Optional[float]:
    """TP_OVERLAP_HEAP_TIMEOUT_S: seconds a kernel waits on a peer. TP_OVERLAP_SPIN_LIMIT, the count of
    polls it replaced, is no longer read: setting it warns, naming `setting` (where the bound is set)."""
    if os.environ.get("TP_OVERLAP_SPIN_LIMIT"):
        warnings.warn(f"TP_OVERLAP_SPIN_LIMIT is no longer read: waits are bounded in seconds by {setting}",
                      stacklevel=4)
    raw = os.environ.get("TP_OVERLAP_HEAP_TIMEOUT_S")
    return float(raw) if raw is not None else None


def env_cache_dir() -> Path:
    """Where `tp-overlap tune` keeps its tables and measurements: $TP_OVERLAP_CACHE, else
    $XDG_CACHE_HOME/tp-overlap, else ~/.cache/tp-overlap."""
    if os.environ.get("TP_OVERLAP_CACHE"):
        return Path(os.environ["TP_OVERLAP_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "tp-overlap"
    return Path.home() / ".cache" / "tp-overlap"


def env_share_gpus() -> bool:
    """TP_OVERLAP_SHARE_GPUS=1: GPU runs may put several ranks on a GPU (4- and 8-rank tests on 2 GPUs)."""
    return os.environ.get("TP_OVERLAP_SHARE_GPUS") == "1"


def env_triton_interpret() -> Optional[str]:
    """TRITON_INTERPRET as set (Triton reads it when it is imported), None when unset."""
    return os.environ.get("TRITON_INTERPRET")


def env_launcher_rank() -> Optional[tuple[int, int, int]]:
    """(RANK, WORLD_SIZE, LOCAL_RANK) when a launcher (torchrun) started this process, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        r, w = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return r, w, int(os.environ.get("LOCAL_RANK", r))
    return None


STEP_TRACE_ENV = "TP_OVERLAP_STEP_TRACE"


def env_step_trace() -> Optional[str]:
    """TP_OVERLAP_STEP_TRACE: a file the engine appends per-step timings to (serving/step_trace.py)."""
    return os.environ.get(STEP_TRACE_ENV) or None


def env_api_key(openai_too: bool = False, vllm_too: bool = False) -> Optional[str]:
    """TP_OVERLAP_API_KEY: the server's key (and the load generator's); with `vllm_too` (the server),
    VLLM_API_KEY after it, as `vllm serve` reads it; with `openai_too`, OPENAI_API_KEY after it (the load
    generator talks to any OpenAI-compatible server)."""
    key = os.environ.get("TP_OVERLAP_API_KEY")
    if not key and vllm_too:
        key = os.environ.get("VLLM_API_KEY")
    if not key and openai_too:
        key = os.environ.get("OPENAI_API_KEY")
    return key or None


def env_max_request_body_bytes() -> Optional[int]:
    """TP_OVERLAP_MAX_REQUEST_BODY_BYTES: the server's request body limit (--max-request-body-bytes' default)."""
    raw = os.environ.get("TP_OVERLAP_MAX_REQUEST_BODY_BYTES")
    return int(raw) if raw else None


def env_tune_fake_step_ms() -> dict:
    """TP_OVERLAP_TUNE_FAKE_STEP_MS: a JSON object of engine-check step times that tests impose
    (tuning/engine_check.py); {} when unset."""
    return json.loads(os.environ.get("TP_OVERLAP_TUNE_FAKE_STEP_MS") or "{}")


def env_tune_fail() -> dict:
    """TP_OVERLAP_TUNE_FAIL: a JSON object {"<phase>/<key>": "check" | "crash"} of tune rows that tests make
    fail on purpose (tuning/phases.py); {} when unset."""
    return json.loads(os.environ.get("TP_OVERLAP_TUNE_FAIL") or "{}")
