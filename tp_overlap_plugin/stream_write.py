"""The stream write-value: a 4-byte store into device memory queued on a stream as a memory operation
(cuStreamWriteValue32 / hipStreamWriteValue32), ordered after every earlier write of the stream,
copy-engine writes to peers included. The copy-engine push of AG-GEMM raises its flags with it."""

from __future__ import annotations

import ctypes

import torch

from tp_overlap_plugin.heap_ipc import load_runtime


_WRITE_VALUE: list = []  # the driver's stream write-value function, once loaded


def _stream_write_value_fn():
    """cuStreamWriteValue32 (the CUDA driver) or hipStreamWriteValue32 (the HIP runtime), through ctypes:
    torch exposes no stream write-value for arbitrary device memory (torch 2.11-2.13 have one only
    inside symmetric memory's private ops)."""
    if not _WRITE_VALUE:
        hip = torch.version.hip is not None
        lib = load_runtime(True) if hip else ctypes.CDLL("libcuda.so.1")
        names = ["hipStreamWriteValue32"] if hip else ["cuStreamWriteValue32_v2", "cuStreamWriteValue32"]
        fn = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if fn is None:
            raise RuntimeError(f"the GPU runtime has none of {names}; the copy-engine push needs a stream write-value")
        fn.restype = ctypes.c_int
        # (stream, address, value, flags): CUdeviceptr is a 64-bit integer, hip takes a void*
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64 if not hip else ctypes.c_void_p, ctypes.c_uint32,
                       ctypes.c_uint]
        _WRITE_VALUE.append(fn)
    return _WRITE_VALUE[0]


def stream_write_value32(word: torch.Tensor, value: int) -> None:
    """Enqueue on the current stream a write of `value` into the 4-byte word `word` (device memory), as
    a stream memory operation with default flags: the driver fences every earlier write of the
    stream system-wide before it, copy-engine writes to peers included. Capturable in a graph (the
    value is then fixed)."""
    if word.element_size() * word.numel() < 4 or word.data_ptr() % 4:
        raise ValueError("stream_write_value32 needs an aligned 4-byte word")
    stream = torch.cuda.current_stream(word.device).cuda_stream
    rc = _stream_write_value_fn()(stream, word.data_ptr(), value & 0xFFFFFFFF, 0)
    if rc != 0:
        raise RuntimeError(f"stream write-value failed with error code {rc}")
