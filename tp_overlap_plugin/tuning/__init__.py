"""What `tp-overlap tune` measures, and the one copy of that code: the bench/ scripts of the same names
are command lines over these modules.

  timing        timers: device events, CUDA-graph replays, interleaved repeats, wall clock on the CPU
  results       the environment of a run, JSON + markdown output
  shapes        the shipped model configs' dims (a model's shard shapes: tp_overlap_plugin/shapes.py)
  gemm_configs  the GEMM core's tile configs against cuBLAS -> the GEMM config table
  decode_configs  the decode matmul's configs against F.linear -> the decode config table
  gemv          decode-sized matmuls: our GEMV against F.linear
  silu_mul      gate_up with SiLU-mul in our decode matmul's or GEMM's epilogue against the matmul + the kernel
  all_reduce    our all-reduce (one-shot, two-shot) and fused all-reduce + norm against NCCL/RCCL
  fused_ops     AG-GEMM / GEMM-RS against the sequential collective + GEMM
  gemm_ar       GEMM + all-reduce in one kernel against F.linear + an all-reduce
  engine_check  the engine's verdict: whole steps, the stock engine against the flag's, per step size
  rules         measurements -> the dispatch table (the "never slower than stock" decisions)
  plan          what one tune run measures: per phase its items, the heap, the time estimate
  store         the measurements, per device and TP size, one file per phase, resumable
  phases        the phases as the W ranks run them (shared out, or collective)
  report        the store -> the tables and the evidence (markdown, PNG)
  tune          the run: the plan, the ranks, the tables
  cli           the whole `tp-overlap` command: serving's subcommands and `tune`
"""
