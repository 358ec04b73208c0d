"""Triton kernels (imported as tp_overlap_plugin.kernels).

One vocabulary in every kernel (a test checks the parameter names):
- `WORLD` (constexpr): the number of ranks; prose and comments write it W.
- `PEERS` (constexpr): the columns of a receive tile, WORLD - 1 rounded up to a power of two
  (tl.arange needs one); only columns < WORLD - 1 hold a peer.
- `rank, heap_bases, error_ptr`: me, the heap base of every rank, my heap's error slot
  (kernels/error_slot.py), in that order after a kernel's tensors and sizes; rma.py's helpers
  take the local pointer first, then `rank, peer, heap_bases`.
- Constexpr flags are passed by keyword at a helper's call site unless their position is the whole
  meaning (`gemm_tile(..., TMA=TMA)`, `store_tile(..., CACHE=PEER_STORE)`): a bare True/False says nothing.
"""
