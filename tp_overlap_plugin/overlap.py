"""Host ops for the overlapped tensor-parallel matmuls: `gemm` (and `gemm_silu_mul`, gate_up_proj with
its activation in the epilogue), `AllGatherGemm`, `GemmReduceScatter`,
and `GemmAllReduce` (decode-sized row-parallel layers in the replicated layout); and `gemv`, the
decode matmul for 1..64 rows (kernels/gemv.py's FMA stream, or the core's tiles with the operands
swapped; decode_config.py), which the layers use where it beats F.linear.

All of them run the one GEMM core's tiles (kernels/gemm.py), each in one persistent launch whatever
the world size; the fused ops synchronise ranks per row block or tile through flags in the heap,
and keep every per-call state in device memory, so they can be captured in CUDA graphs. Tile shapes
come from `pick_config`, a deterministic function of the shape and device (measured, not autotuned
per process, so runs are reproducible and every rank tiles alike).
Cases a kernel does not cover (dtype, layout, capacity) fall back to the stock torch op, never to
a wrong answer; `stats` records which path ran.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import triton

from tp_overlap_plugin import runtime, stats
from tp_overlap_plugin.collectives import (alloc_row_slots, cache_modifiers, resident_programs, row_slots_bytes,
                                          warp_size)
from tp_overlap_plugin.decode_config import FMA_MAX_ROWS, MAX_ROWS, DecodeConfig, pick_decode_config
from tp_overlap_plugin.gemm_config import (TileConfig, gemm_all_reduce_config, pick_config,  # noqa: F401
                                           prefers_cublas)
from tp_overlap_plugin.heap import SymmetricHeap
from tp_overlap_plugin.launch import Launcher
from tp_overlap_plugin.kernels import triton_compat
from tp_overlap_plugin.kernels.lamport import peers_pow2, tile_elems
from tp_overlap_plugin.kernels.gemm import gemm_kernel
from tp_overlap_plugin.kernels.ag_gemm import ag_gemm_kernel
from tp_overlap_plugin.kernels.gemm_ar import gemm_all_reduce_kernel
from tp_overlap_plugin.kernels.gemm_rs import gemm_rs_kernel
from tp_overlap_plugin.kernels.gemv import gemv_kernel

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# GEMM-RS splits each shard's tiles into this many runs, so that my own rows wait only for partials
# stored a run earlier (kernels/gemm_rs.py). Fixed, so the kernel compiles once per world size.
RS_CHUNKS = 2


def num_programs(device: torch.device) -> int:
    """Persistent grid size: one program per SM. The interpreter runs programs one after another;
    one program walks all tiles in order there."""
    return resident_programs(device, cross_program_waits=True)


def _check_operands(op: str, a: torch.Tensor, b: torch.Tensor, device: torch.device) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{op}: expected 2-D operands, got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: inner dimensions differ: a{tuple(a.shape)} @ b{tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: dtypes differ: a is {a.dtype}, b is {b.dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def _kernel_applies(a: torch.Tensor) -> bool:
    # the fused ops slice A by rows and hand the slices to the core; B may be any view
    return a.dtype in KERNEL_DTYPES and a.is_contiguous()


def _describable(t: torch.Tensor) -> bool:
    """A tensor descriptor can cover t as a row-major 2-D array: unit inner stride, 16-byte aligned
    base and row stride, 16-bit elements."""
    return (t.dtype in KERNEL_DTYPES and t.shape[0] > 0 and t.shape[1] > 0 and t.stride(1) == 1
            and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0)


def _operand_descriptors(a: torch.Tensor, b: torch.Tensor, cfg: TileConfig):
    """(a_desc, b_desc, b_kmajor), or None where the operands must go by pointer. B as an nn.Linear
    weight transposed (K contiguous) is described as the weight itself, [N, K]. With device_desc
    the kernel builds the descriptors from the pointers and strides: the tensors go as they are."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    if not _describable(a):
        return None
    kmajor = b.stride(0) == 1 and _describable(b.t())
    if not kmajor and not _describable(b):
        return None
    if cfg.device_desc:
        return a, b, kmajor
    a_desc = TensorDescriptor(a, list(a.shape), [a.stride(0), 1], [cfg.block_m, cfg.block_k])
    if kmajor:
        return a_desc, TensorDescriptor(b.t(), [b.shape[1], b.shape[0]], [b.stride(1), 1],
                                        [cfg.block_n, cfg.block_k]), True
    return a_desc, TensorDescriptor(b, list(b.shape), [b.stride(0), 1], [cfg.block_k, cfg.block_n]), False


MIN_K_BLOCKS_PER_SLICE = 4  # shorter slices cannot fill a pipeline


def split_slices(cfg: TileConfig, tiles: int, k_blocks: int, programs: int) -> int:
    """K slices per tile for this launch. Auto (split_k=0) splits only when the tiles would leave at
    least half of the SMs idle, as far as the SMs fill; slice count rounded so none is empty."""
    if cfg.split_k == 1:
        return 1
    if cfg.split_k > 1:
        s = cfg.split_k
    elif tiles * 2 > programs:
        return 1
    else:
        s = min(programs // tiles, k_blocks // MIN_K_BLOCKS_PER_SLICE)
    s = max(1, min(s, k_blocks))
    per = -(-k_blocks // s)
    return -(-k_blocks // per)


# Split-K scratch per (device, stream): fp32 partials and per-tile arrival counters (zero between
# launches: the last arrival resets its counter). Outgrown buffers stay referenced, because a
# captured CUDA graph may still write them.
_SPLIT_SCRATCH: dict = {}
_RETIRED_SCRATCH: list = []


def _split_scratch(device: torch.device, cells: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    ws, counts = _SPLIT_SCRATCH.get(key, (None, None))
    if ws is None or ws.numel() < cells or counts.numel() < tiles:
        if ws is not None:
            _RETIRED_SCRATCH.append((ws, counts))
        ws = torch.empty(max(cells, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        counts = torch.zeros(max(tiles, 0 if counts is None else counts.numel()), dtype=torch.int32, device=device)
        _SPLIT_SCRATCH[key] = (ws, counts)
    return ws, counts


class _DescriptorScratch:
    """Triton's allocator for kernels that build tensor descriptors in device memory: a buffer per
    (device, stream), grown, never freed (a captured graph keeps its address). Installed only
    around our own launches, so a caller's allocator stays theirs."""

    def __init__(self):
        self.buffers: dict = {}
        self.retired: list = []

    def __call__(self, size: int, alignment: int, stream):
        dev = torch.device("cuda", torch.cuda.current_device())
        key = (dev, stream)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < size + alignment:
            if buf is not None:
                self.retired.append(buf)
            buf = self.buffers[key] = torch.empty(size + alignment, dtype=torch.int8, device=dev)
        return buf[(-buf.data_ptr()) % alignment:]


_DESCRIPTOR_SCRATCH = _DescriptorScratch()


@contextlib.contextmanager
def _descriptor_allocator(active: bool):
    if not active:
        yield
        return
    with triton_compat.allocator(_DESCRIPTOR_SCRATCH):
        yield


def _eager_config(cfg: TileConfig) -> TileConfig:
    """The fused ops' config: the table's tiles, operands and C by pointer. Rows a peer delivers
    are read with ordinary loads, which the flag's acquire orders (nothing portable orders the
    tensor-copy engine's reads after it), and C may be a peer's heap. Descriptors would also cost
    40-60 us more host time per launch (bench/results/gemm-launch-h200-2026-11-22)."""
    return dataclasses.replace(cfg, tma=False, c_tma=False, device_desc=False, warp_spec=False)


def silu_mul_config(cfg: TileConfig) -> TileConfig:
    """What gemm_silu_mul runs for the plain GEMM's config `cfg`. The table's tile spans block_n
    columns of B: half of them gate, half up, for block_n / 2 columns of C. Split-K would activate
    partial sums. Flattened, ptxas serializes the two accumulators' wgmmas (its warning C7515, with
    Triton 3.6 and 3.9: the per-tile reset of both accumulators sits inside the MMA pipeline),
    which cost the fused kernel ~25% on H100 (bench/notes/gemm.md); unflattened they stay
    asynchronous. Warp-specialized, it left outputs unwritten on H100 (Triton 3.6): not used."""
    return dataclasses.replace(cfg, block_n=cfg.block_n // 2, split_k=1, flatten=False, warp_spec=False)


def _launch(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, cfg: TileConfig, silu_mul: bool = False) -> None:
    m, k = a.shape
    n = out.shape[1]
    if silu_mul:
        cfg = silu_mul_config(cfg)
    dev = a.device
    interpret = dev.type == "cpu"
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    k_blocks = -(-k // cfg.block_k)
    programs = num_programs(dev)
    descs = _operand_descriptors(a, b, cfg) if cfg.tma else None
    a_arg, b_arg, b_kmajor = descs if descs is not None else (a, b, False)
    c_desc = out
    c_tma = descs is not None and cfg.c_tma and _describable(out)
    device_desc = descs is not None and cfg.device_desc
    if c_tma and not device_desc:
        from triton.tools.tensor_descriptor import TensorDescriptor
        c_desc = TensorDescriptor(out, list(out.shape), [out.stride(0), 1],
                                  [cfg.block_m, cfg.block_n // 2 if cfg.subtile else cfg.block_n])
    slices = split_slices(cfg, tiles, k_blocks, programs)
    ws, counts = _split_scratch(dev, tiles * slices * cfg.block_m * cfg.block_n, tiles) if slices > 1 else (out, out)
    work = tiles * slices
    grid = (min(work, programs) if cfg.persistent else work,)
    # flattening and warp groups need a plain tile loop: not with split-K's counter and reduction
    plain = slices == 1 and not interpret
    warp_spec = cfg.warp_spec and plain and descs is not None
    with _descriptor_allocator(device_desc and not interpret):
        gemm_kernel[grid](a_ptr=a_arg, b_ptr=b_arg, c_ptr=out, M=m, N=n, K=k, stride_am=a.stride(0),
                          stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1), stride_cm=out.stride(0),
                          stride_cn=out.stride(1), c_desc=c_desc, split_ws_ptr=ws, split_count_ptr=counts,
                          split_k=slices, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          GROUP_M=cfg.group_m,
                          EVEN_K=k % cfg.block_k == 0, INTERPRET=interpret,
                          FLATTEN=cfg.flatten and plain and not warp_spec,
                          TMA=descs is not None, B_KMAJOR=b_kmajor, C_TMA=c_tma, SUBTILE=cfg.subtile,
                          WARP_SPEC=warp_spec, SPLIT=slices > 1, DEVICE_DESC=device_desc, SILU_MUL=silu_mul,
                          num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
         config: TileConfig | None = None) -> torch.Tensor:
    """C = A @ B with our persistent Triton GEMM (the core the fused ops share)."""
    _check_operands("gemm", a, b, a.device)
    m, k = a.shape
    n = b.shape[1]
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0 or a.dtype not in KERNEL_DTYPES + (torch.float32,):
        return torch.matmul(a, b, out=out)
    _launch(a, b, out, config or pick_config(m, n, k, a.device))
    return out


def gemm_silu_mul_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The fused gate_up + SiLU-mul's cases: 16-bit floats alike on one device, A [M, K] contiguous,
    B [K, 2n] (gate | up) of any strides, 2n even and K > 0."""
    return (a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and a.shape[1] > 0 and b.shape[1] % 2 == 0
            and b.shape[1] > 0 and a.dtype in KERNEL_DTYPES and b.dtype == a.dtype and a.is_contiguous()
            and a.device == b.device)


def gemm_silu_mul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
                  config: TileConfig | None = None) -> torch.Tensor:
    """silu(A @ B[:, :n]) * (A @ B[:, n:]) with B = [K, 2n] (gate | up: gate_up_proj's weight, transposed)
    in one launch of the GEMM core, the activation in its epilogue: the [M, 2n] product is never
    written. `config`: the plain GEMM's tiles for [M, K] x [K, 2n] (default: the table's); run
    without split-K, flattening or warp groups (silu_mul_config says why). fp32 sums, activated, rounded once."""
    if not gemm_silu_mul_applies(a, b):
        raise ValueError(f"gemm_silu_mul: takes a contiguous A [M, K] and B [K, 2n] (gate | up), K > 0, both of one "
                         f"16-bit dtype ({', '.join(map(str, KERNEL_DTYPES))}) on one device; got a{tuple(a.shape)} "
                         f"{a.dtype} {a.device} contiguous={a.is_contiguous()}, b{tuple(b.shape)} {b.dtype} {b.device}")
    m, k = a.shape
    n = b.shape[1] // 2
    if out is None:
        out = torch.empty((m, n), dtype=a.dtype, device=a.device)
    elif out.shape != (m, n) or out.dtype != a.dtype or out.device != a.device:
        raise ValueError(f"gemm_silu_mul: out must be [{m}, {n}] {a.dtype} on {a.device}, got {tuple(out.shape)} "
                         f"{out.dtype} {out.device}")
    if m:
        _launch(a, b, out, config or pick_config(m, 2 * n, k, a.device), silu_mul=True)
    return out


GEMV_MAX_ROWS = MAX_ROWS


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The decode matmul's cases: 1..GEMV_MAX_ROWS rows, 16-bit floats alike, unit stride along K."""
    return (x.dim() == 2 and weight.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS and x.shape[1] == weight.shape[1]
            and x.shape[1] > 0 and x.dtype in KERNEL_DTYPES and weight.dtype == x.dtype and x.stride(1) == 1
            and weight.stride(1) == 1 and x.device == weight.device)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, config: DecodeConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for decode-sized x ([M, K], M <= GEMV_MAX_ROWS; weight [N, K]): the
    decode matmul. `config` (default: the device's measured table, decode_config.pick_decode_config)
    picks the path: the FMA weight stream (kernels/gemv.py) or the GEMM core's tensor-core tiles with
    the operands swapped (y^T = W @ x^T). fp32 accumulation; the same bits on every call and rank."""
    if not gemv_applies(x, weight):
        raise ValueError(f"gemv: takes x [M, K] with 1 <= M <= {GEMV_MAX_ROWS} (GEMV_MAX_ROWS) and a weight [N, K] "
                         f"of x's 16-bit dtype ({', '.join(map(str, KERNEL_DTYPES))}), both with unit stride "
                         f"along K, on one device; got x{tuple(x.shape)} {x.dtype} stride {tuple(x.stride())}, "
                         f"weight{tuple(weight.shape)} {weight.dtype} stride {tuple(weight.stride())}")
    m, k = x.shape
    n = weight.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be a contiguous [{n}] {x.dtype} tensor, got {tuple(bias.shape)} {bias.dtype}")
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"gemv: out must be [{m}, {n}] {x.dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if n == 0:
        return out
    cfg = config or pick_decode_config(m, n, k, x.device)
    if not cfg.takes(m):
        raise ValueError(f"gemv: config {cfg.label()} does not take {m} rows (the FMA path takes at most "
                         f"{FMA_MAX_ROWS})")
    stats.record("gemv.kernel")
    if cfg.path == "mma":
        # the core's C is y^T: tile rows are weight rows (y's columns), tile columns are x's rows
        _launch(weight, x.t(), out.t(), cfg.tile_config(m))
        if bias is not None:
            out += bias
        return out
    gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x_ptr=x, w_ptr=weight, bias_ptr=bias if bias is not None else x, y_ptr=out, M=m, N=n, K=k,
        stride_xm=x.stride(0), stride_wn=weight.stride(0), stride_ym=out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, NUM_STAGES=cfg.num_stages,
        EVEN_K=k % cfg.block_k == 0, HAS_BIAS=bias is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        # the FMA chain needs contraction; Triton 3.10 turns it off by default (the interpreter takes no options)
        **({} if x.device.type == "cpu" else {"enable_fp_fusion": True}))
    return out


def _fused_config(rows: int, n: int, k: int, device: torch.device, config: TileConfig | None) -> TileConfig:
    return config or _eager_config(pick_config(rows, n, k, device))


# AG-GEMM's push (kernels/ag_gemm.py). A piece is the unit a pusher moves before its releasing
# add, which waits for the piece's stores to land: large enough that the wait is a small share of
# the piece's time at one program's store rate (~25-45 GB/s into a peer, bench/notes/ag_gemm.md),
# small enough that the first pieces land early.
PIECE_BYTES = 256 << 10
PUSH_STEP_ELEMS = 16384      # elements one push step moves (32 KB of bf16: 64-128 B per thread)
PUSHERS_PER_PEER = 8         # ~8 programs fill the links to one peer (bench/results/remote-bw-tp2-*)
# AG-GEMM multiplies the peers' rows in this many runs of row blocks, a wait before each (a constexpr:
# one kernel per world size; runs beyond the shard's row blocks are empty). Each run is one more copy
# of the tile loop in the compiled kernel: with 2, ptxas takes 1.2x as long as on v3's kernel, with
# 4 over 2x (sm_90, bench/notes/ag_gemm.md); 2 already end a link-bound shape about one run's
# compute after the link.
AG_SEGMENTS = 2
# The device's dense 16-bit FLOP/s over the bytes per second it pushes into its peers: H200 ~750
# TFLOP/s over ~340 GB/s (DESIGN.md section 9). push_plan's estimate of when the pushes end, in
# units of the GEMM's time; tune measures plans in its stead.
FLOPS_PER_PUSHED_BYTE = 2200


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """How AG-GEMM's programs move my shard into the peers' heaps (kernels/ag_gemm.py)."""
    pushers: int     # the first `pushers` programs push, then join the GEMM
    piece_rows: int  # rows per piece (one releasing add per piece and peer); a power of two dividing BLOCK_M
    push_cols: int   # columns per push step (a power of two)
    join: int = 0    # the first segment of peers' rows the pushers multiply (the others take the earlier alone)


def push_plan(rows: int, n: int, k: int, elem_bytes: int, world: int, programs: int, block_m: int,
              segments: int = AG_SEGMENTS) -> PushPlan:
    """The default: PUSHERS_PER_PEER programs per peer, at most a quarter of the SMs (one program
    where the grid is one: the interpreter); pieces of about PIECE_BYTES. The pushers join at the
    first segment the others would not have started yet when the pushes end, by the estimate
    T_push / T_gemm = (W - 1) / W * FLOPS_PER_PUSHED_BYTE * elem_bytes / (2 N): until then the
    others multiply my rows (1 / W of the GEMM) and the earlier segments."""
    pushers = min(max(1, min(PUSHERS_PER_PEER * (world - 1), programs // 4)), programs)
    piece_rows = 1 << max(0, (PIECE_BYTES // max(k * elem_bytes, 1)).bit_length() - 1)
    piece_rows = min(piece_rows, block_m)  # not clamped to the rows: one kernel per tile config
    push_cols = min(triton.next_power_of_2(k), max(16, PUSH_STEP_ELEMS // piece_rows))
    used = min(segments, -(-rows // block_m))  # segments that hold row blocks
    slower = programs / max(programs - pushers, 1)  # the others' time for a share of the whole grid's
    push_end = (world - 1) / world * FLOPS_PER_PUSHED_BYTE * elem_bytes / (2 * n)
    join = 0
    while join < used - 1 and slower * (1 + join * (world - 1) / used) / world < push_end:
        join += 1
    return PushPlan(pushers, piece_rows, push_cols, join)


class AllGatherGemm:
    """c = all_gather(a_shard) @ b, the gather hidden behind the GEMM, in one persistent launch
    (kernels/ag_gemm.py): a few of its programs push my shard into every peer's heap at once, piece
    by piece, each piece followed by a count in that peer's heap; the others multiply my rows, and
    all of them the peers' rows, run by run of row blocks as their pieces are counted in. The rows a
    peer delivered stay in `gathered[half, slot]` (half = the call number's parity, slot =
    (src - me - 1) mod W) until the call after next.

    Capacity is fixed at construction (heap space is symmetric): `max_rows` rows per shard, `k`
    columns. Every call's state (call number) lives in device memory, so calls can be captured in
    CUDA graphs and replayed; a call is one launch, with no host work per peer."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, k: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, segments: int = AG_SEGMENTS):
        if max_rows < 1 or k < 1 or segments < 1:
            raise ValueError(f"AllGatherGemm needs max_rows, k, segments >= 1; got {max_rows}, {k}, {segments}")
        self.heap, self.max_rows, self.k, self.dtype, self.segments = heap, max_rows, k, dtype, segments
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        slots = max(heap.world_size - 1, 1)
        self.gathered = heap.alloc((2, slots, max_rows, k), dtype, name="ag_gemm.gathered")
        self.counts = heap.alloc((2, slots, segments), torch.int64, name="ag_gemm.counts")
        self.counts.zero_()
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.programs = num_programs(heap.device)
        self.stream_order = runtime.StreamOrder()
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, max_rows: int, k: int, dtype: torch.dtype, segments: int = AG_SEGMENTS) -> int:
        """Heap one op takes: two halves of W - 1 receive slots, and their counts (256-byte aligned)."""
        slots = max(world - 1, 1)
        es = torch.empty((), dtype=dtype).element_size()
        return -(-2 * slots * max_rows * k * es // 256) * 256 + -(-2 * slots * segments * 8 // 256) * 256

    def received(self, src: int, rows: int) -> torch.Tensor:
        """The rows rank `src` delivered for the last finished call (tests read them)."""
        half = int(self.calls[1]) % 2
        return self.gathered[half, (src - self.heap.rank - 1) % self.heap.world_size, :rows]

    def __call__(self, a_shard: torch.Tensor, b: torch.Tensor, config: TileConfig | None = None,
                 plan: PushPlan | None = None) -> torch.Tensor:
        h = self.heap
        _check_operands("ag_gemm", a_shard, b, h.device)
        rows, k = a_shard.shape
        n = b.shape[1]
        W = h.world_size
        fits = rows <= self.max_rows and k == self.k and a_shard.dtype == self.dtype
        if rows == 0 or n == 0 or W == 1 or not fits or not _kernel_applies(a_shard):
            stats.record("ag_gemm.fallback")
            return runtime.all_gather(a_shard, self.device_group) @ b
        self.stream_order.before_call(h.device)
        stats.record("ag_gemm.kernel")
        cfg = _fused_config(rows, n, k, h.device, config)
        plan = plan or push_plan(rows, n, k, a_shard.element_size(), W, self.programs, cfg.block_m, self.segments)
        if cfg.block_m % plan.piece_rows or plan.pushers < 1:
            raise ValueError(f"ag_gemm: {plan} needs pushers >= 1 and piece_rows dividing BLOCK_M={cfg.block_m}")
        c = torch.empty((W * rows, n), dtype=a_shard.dtype, device=h.device)
        ag_gemm_kernel[(self.programs,)](
            a_ptr=a_shard, b_ptr=b, c_ptr=c, gathered_ptr=self.gathered, counts_ptr=self.counts, calls_ptr=self.calls,
            rows=rows, N=n, K=k, stride_bk=b.stride(0), stride_bn=b.stride(1), slot_stride=self.max_rows * k,
            pushers=plan.pushers, join=plan.join, rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error, WORLD=W,
            SEGMENTS=self.segments, PIECE_ROWS=plan.piece_rows, PUSH_COLS=plan.push_cols, BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0,
            INTERPRET=h.device.type == "cpu", FLATTEN=cfg.flatten, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
        h.check_if_free()
        return c


class GemmReduceScatter:
    """c_shard = reduce_scatter(a @ b): rank r gets rows [r*M/W, (r+1)*M/W) of the sum over ranks,
    in one persistent launch (kernels/gemm_rs.py): peers' rows first, chunk by chunk, stored straight
    into their owners' heaps (every owner at once), and my own rows a chunk behind, whose tiles sum
    the arrived partials in rank order.

    M not divisible by W is padded with zero rows to the next multiple; the padding rows come back
    as zeros at the end of the last rank's shard. Capacity: `max_rows` rows per shard, `n`
    columns. Call state lives in device memory, so calls can be captured in CUDA graphs."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16,
                 device_group: dist.ProcessGroup | None = None, chunks: int = RS_CHUNKS):
        if max_rows < 1 or n < 1 or chunks < 1:
            raise ValueError(f"GemmReduceScatter needs max_rows, n, chunks >= 1; got {max_rows}, {n}, {chunks}")
        self.heap, self.max_rows, self.n, self.dtype, self.chunks = heap, max_rows, n, dtype, chunks
        self.device_group = device_group if device_group is not None else dist.group.WORLD
        W = heap.world_size
        slots = max(W - 1, 1)
        self.recv = heap.alloc((2, slots, max_rows, n), dtype, name="gemm_rs.recv")
        self.counts = heap.alloc((2, slots, chunks), torch.int64, name="gemm_rs.counts")
        self.counts.zero_()
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.programs = num_programs(heap.device)
        self.stream_order = runtime.StreamOrder()
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, max_rows: int, n: int, dtype: torch.dtype, chunks: int = RS_CHUNKS) -> int:
        """Heap one op takes: two halves of W - 1 receive slots, and their counts (256-byte aligned)."""
        return AllGatherGemm.heap_bytes(world, max_rows, n, dtype, chunks)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, config: TileConfig | None = None) -> torch.Tensor:
        h = self.heap
        _check_operands("gemm_rs", a, b, h.device)
        W = h.world_size
        m, k = a.shape
        n = b.shape[1]
        if m % W:
            a = torch.cat([a, a.new_zeros((W - m % W, k))])
        rows = a.shape[0] // W
        fits = rows <= self.max_rows and n == self.n and a.dtype == self.dtype
        if rows == 0 or k == 0 or W == 1 or not fits or not _kernel_applies(a):
            stats.record("gemm_rs.fallback")
            return runtime.reduce_scatter(a @ b, self.device_group)
        self.stream_order.before_call(h.device)
        stats.record("gemm_rs.kernel")
        cfg = _fused_config(rows, n, k, h.device, config)
        c = torch.empty((rows, n), dtype=a.dtype, device=h.device)
        gemm_rs_kernel[(self.programs,)](
            a_ptr=a, b_ptr=b, c_ptr=c, recv_ptr=self.recv, rows=rows, N=n, K=k, stride_am=a.stride(0),
            stride_bk=b.stride(0), stride_bn=b.stride(1), slot_stride=self.max_rows * n, counts_ptr=self.counts,
            calls_ptr=self.calls, rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error,
            WORLD=W, CHUNKS=self.chunks, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            GROUP_M=cfg.group_m, EVEN_K=k % cfg.block_k == 0, INTERPRET=h.device.type == "cpu", FLATTEN=cfg.flatten,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        h.check_if_free()
        return c


# GEMM + all-reduce's arguments that change from call to call (the rest is bound per op: launch.py)
_GEMM_AR_VARYING = ("a_ptr", "b_ptr", "bias_ptr", "out_ptr", "M", "K", "stride_am", "stride_bk", "stride_bn", "stride_om",
                    "BLOCK_M", "BLOCK_N", "BLOCK_K", "SUB_M", "GROUP_M", "EVEN_K", "HAS_BIAS")


class GemmAllReduce:
    """out = all_reduce(x @ weight.T) [+ bias], for the replicated (decode) layout's row-parallel layers:
    every rank holds all M rows of its K-slice of x and the matching columns of the nn.Linear weight
    ([n, k]); every rank gets the same sum (fp32, rank order 0..W-1, each rank's partial rounded to
    the dtype first, as F.linear + the all-reduce give). One launch (kernels/gemm_ar.py): the GEMM's
    tile epilogue pushes each tile into every peer's receive slot.

    Capacity is fixed at construction (heap space is symmetric): up to `max_rows` rows of `n`
    columns in `dtype`; receive slots take 2 * W * max_rows * n elements of heap (heap_bytes). Call
    state lives in device memory, so calls can be captured in CUDA graphs. Collective: every rank
    calls it with the same shapes, in the same order. Errors of a wait surface at heap.check()."""

    def __init__(self, heap: SymmetricHeap, max_rows: int, n: int, dtype: torch.dtype = torch.bfloat16):
        if max_rows < 1 or n < 1:
            raise ValueError(f"GemmAllReduce needs max_rows, n >= 1; got {max_rows}, {n}")
        if dtype not in KERNEL_DTYPES:
            raise ValueError(f"GemmAllReduce dtype must be one of {KERNEL_DTYPES}, got {dtype}")
        self.heap, self.max_rows, self.n, self.dtype = heap, max_rows, n, dtype
        self.slots = alloc_row_slots(heap, max_rows, n, dtype, "gemm_ar.slots")
        self.calls = torch.zeros(2, dtype=torch.int64, device=heap.device)  # kernels/calls.py
        self.programs = resident_programs(heap.device)
        self.cache_modifiers = cache_modifiers(heap.device)
        self.warp_size = warp_size(heap.device)
        self._launchers: dict = {}  # per (num_warps, num_stages): launch.Launcher
        self.stream_order = runtime.StreamOrder()
        heap.publish()

    @staticmethod
    def heap_bytes(world: int, max_rows: int, n: int, dtype: torch.dtype) -> int:
        return row_slots_bytes(world, max_rows, n, dtype) + 256

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether __call__ takes these operands (else it raises)."""
        return (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype == self.dtype
                and x.shape[0] <= self.max_rows and tuple(weight.shape) == (self.n, x.shape[1])
                and x.stride(1) == 1 and x.device == weight.device == self.heap.device)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, config: TileConfig | None = None) -> torch.Tensor:
        h = self.heap
        if x.dim() != 2 or weight.dim() != 2:
            raise ValueError(f"gemm_all_reduce: expected 2-D x and weight, got x{tuple(x.shape)} and "
                             f"weight{tuple(weight.shape)}")
        m, k = x.shape
        if m > self.max_rows:
            raise ValueError(f"gemm_all_reduce of M={m} rows exceeds max_rows={self.max_rows} (its receive slots "
                             f"take 2 * world * max_rows * n elements of heap); build GemmAllReduce with a larger "
                             f"max_rows or use F.linear + the all-reduce")
        if x.dtype != self.dtype or weight.dtype != self.dtype:
            raise ValueError(f"gemm_all_reduce was built for {self.dtype}; got x {x.dtype}, weight {weight.dtype}")
        if tuple(weight.shape) != (self.n, k):
            raise ValueError(f"gemm_all_reduce weight must be [n={self.n}, k={k}] (an nn.Linear weight for "
                             f"x{tuple(x.shape)}); got {tuple(weight.shape)}")
        if x.stride(1) != 1:
            raise ValueError(f"gemm_all_reduce x needs unit column stride; got strides {x.stride()}")
        for name, t, shape in (("bias", bias, (self.n,)), ("out", out, (m, self.n))):
            if t is not None and (tuple(t.shape) != shape or t.dtype != self.dtype or t.stride(-1) != 1):
                raise ValueError(f"gemm_all_reduce {name} must be a {self.dtype} tensor of shape {shape} with unit "
                                 f"last stride; got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
        for name, t in (("x", x), ("weight", weight), ("bias", bias), ("out", out)):
            if t is not None and t.device != h.device:
                raise ValueError(f"gemm_all_reduce {name} is on {t.device}, but the heap is on {h.device}")
        if out is None:
            out = torch.empty((m, self.n), dtype=self.dtype, device=h.device)
        if m == 0:
            return out
        self.stream_order.before_call(h.device)
        stats.record("gemm_all_reduce.kernel")
        W = h.world_size
        cfg = config or gemm_all_reduce_config(m, self.n, self.programs, h.device)
        tiles = -(-m // cfg.block_m) * -(-self.n // cfg.block_n)
        peers = peers_pow2(W)
        sub_m = max(1, min(cfg.block_m, tile_elems(cfg.num_warps * self.warp_size) // (cfg.block_n * peers)))
        launch = self._launchers.get((cfg.num_warps, cfg.num_stages))
        if launch is None:
            launch = self._launchers[(cfg.num_warps, cfg.num_stages)] = Launcher(
                gemm_all_reduce_kernel, h.device, _GEMM_AR_VARYING, N=self.n, slots_ptr=self.slots,
                calls_ptr=self.calls, slot_stride=self.slots.stride(0), src_stride=self.slots.stride(1),
                row_stride=self.slots.stride(2), rank=h.rank, heap_bases=h.heap_bases, error_ptr=h.error, WORLD=W,
                PEERS=peers, INTERPRET=h.device.type == "cpu", num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                **self.cache_modifiers)
        launch(min(tiles, self.programs), x, weight, bias if bias is not None else out, out, m, k, x.stride(0),
               weight.stride(1), weight.stride(0), out.stride(0), cfg.block_m, cfg.block_n, cfg.block_k, sub_m,
               cfg.group_m, k % cfg.block_k == 0, bias is not None)
        h.check_if_free()
        return out
