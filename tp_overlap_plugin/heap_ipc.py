"""The heap backend on the GPU runtime's own malloc and IPC handles, through ctypes (libamdhip64 on
ROCm, libcudart on CUDA): the ROCm default, and how ranks that share a GPU map each other's heaps.
`load_runtime` finds the runtime library torch already loaded."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import weakref

import torch
import torch.distributed as dist


class IpcMemHandle(ctypes.Structure):
    """cudaIpcMemHandle_t / hipIpcMemHandle_t: a struct of 64 opaque bytes. IpcOpenMemHandle takes it
    by value; ctypes passes an array as a pointer, which made cudaIpcOpenMemHandle fail (rc=1) on
    H200. A Structure declared in argtypes is passed by value."""
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


def runtime_signatures() -> dict:
    """C signatures of the runtime calls the ipc backend makes, by name without the cuda/hip prefix:
    name -> (restype, argtypes). Both runtimes declare them alike (errors are a C enum, an int)."""
    err = ctypes.c_int
    return {
        "SetDevice": (err, [ctypes.c_int]),
        "Malloc": (err, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]),
        "Free": (err, [ctypes.c_void_p]),
        "IpcGetMemHandle": (err, [ctypes.POINTER(IpcMemHandle), ctypes.c_void_p]),
        "IpcOpenMemHandle": (err, [ctypes.POINTER(ctypes.c_void_p), IpcMemHandle, ctypes.c_uint]),
        "IpcCloseMemHandle": (err, [ctypes.c_void_p]),
        "GetErrorString": (ctypes.c_char_p, [err]),
    }


def configure_runtime(lib, prefix: str):
    """Set restype and argtypes of every runtime function the ipc backend calls on `lib` (a
    ctypes.CDLL, or any object whose `<prefix><name>` attributes take them). Without argtypes ctypes
    guesses each argument's C type from the Python value, and the guess is wrong for the handle."""
    for name, (restype, argtypes) in runtime_signatures().items():
        fn = getattr(lib, prefix + name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


class IpcRuntime:
    """The CUDA or HIP runtime calls behind the ipc backend, through ctypes with declared signatures."""

    LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess = hipIpcMemLazyEnablePeerAccess

    def __init__(self, lib, prefix: str):
        self.lib = configure_runtime(lib, prefix)
        self.prefix = prefix

    def _call(self, name: str, *args) -> None:
        rc = getattr(self.lib, self.prefix + name)(*args)
        if rc != 0:
            what = getattr(self.lib, self.prefix + "GetErrorString")(rc)
            raise RuntimeError(f"{self.prefix}{name} failed with error code {rc}"
                               f" ({what.decode(errors='replace') if what else 'no description'})")

    def set_device(self, index: int) -> None:
        self._call("SetDevice", index)

    def malloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._call("Malloc", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("Free", ptr)

    def get_handle(self, ptr: int) -> bytes:
        handle = IpcMemHandle()
        self._call("IpcGetMemHandle", ctypes.byref(handle), ptr)
        return bytes(handle)

    def open_handle(self, handle: bytes) -> int:
        ptr = ctypes.c_void_p()
        self._call("IpcOpenMemHandle", ctypes.byref(ptr), IpcMemHandle.from_buffer_copy(handle),
                   self.LAZY_ENABLE_PEER_ACCESS)
        return ptr.value

    def close_handle(self, ptr: int) -> None:
        self._call("IpcCloseMemHandle", ptr)


class IpcBackend:
    """Runtime malloc + IPC handles through ctypes (libamdhip64 on ROCm, libcudart on CUDA).

    The heap must come from the runtime's own malloc (IPC on memory from torch's caching allocator
    failed here), and peers' handles are opened on the local device: opening them under the
    peer's device guard gave addresses the kernel faulted on. The runtime is told the device
    itself: if this process has two copies of the runtime (torch's and a system one), torch's
    device guard sets only its own copy's current device."""

    def __init__(self, heap):
        self.heap = heap
        hip = torch.version.hip is not None
        self.rt = IpcRuntime(load_runtime(hip), "hip" if hip else "cuda")
        self.local_ptr = 0
        self.opened: list[int] = []

    def map(self):
        h = self.heap
        with torch.cuda.device(h.device):
            self.rt.set_device(h.device.index)
            self.local_ptr = self.rt.malloc(h.heap_size)
            handles = [None] * h.world_size
            dist.all_gather_object(handles, self.rt.get_handle(self.local_ptr), group=h.group)
            ptrs = []
            for r, handle in enumerate(handles):
                if r == h.rank:
                    ptrs.append(self.local_ptr)
                    continue
                peer_ptr = self.rt.open_handle(handle)
                self.opened.append(peer_ptr)
                ptrs.append(peer_ptr)
        buffers = [_wrap_device_pointer(p, h.heap_size, h.device, owner=self) for p in ptrs]
        return buffers[h.rank], buffers

    def close(self):
        with torch.cuda.device(self.heap.device):
            torch.cuda.synchronize()
            self.rt.set_device(self.heap.device.index)
            for p in self.opened:
                with contextlib.suppress(RuntimeError):
                    self.rt.close_handle(p)
            self.opened.clear()
            if self.local_ptr:
                with contextlib.suppress(RuntimeError):
                    self.rt.free(self.local_ptr)
                self.local_ptr = 0


def load_runtime(hip: bool):
    stem = "libamdhip64.so" if hip else "libcudart.so"
    names = ([stem, stem + ".6", stem + ".7"] if hip else [stem, stem + ".13", stem + ".12"])
    found = ctypes.util.find_library("amdhip64" if hip else "cudart")
    if found:
        names.insert(0, found)
    # The copy torch already loaded comes first: one runtime, one device state, one set of mappings.
    names[:0] = _loaded_libraries(stem)
    if not hip:
        # pip wheels of the CUDA runtime sit beside torch rather than on the loader path
        try:
            import nvidia.cuda_runtime as ncr  # type: ignore
            for d in ncr.__path__:
                for sub in ("lib", ""):
                    libdir = os.path.join(d, sub)
                    if os.path.isdir(libdir):
                        names += [os.path.join(libdir, f) for f in sorted(os.listdir(libdir))
                                  if f.startswith("libcudart.so")]
        except ImportError:
            pass
    errors = []
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError as e:
            errors.append(f"{n}: {e}")
    raise RuntimeError("heap backend 'ipc' could not load the GPU runtime: " + "; ".join(errors))


def _loaded_libraries(stem: str) -> list[str]:
    """Paths of shared objects named `stem*` already mapped into this process (Linux)."""
    paths = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith(stem) and path not in paths:
                    paths.append(path)
    return paths


class _DeviceArray:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


def _wrap_device_pointer(ptr: int, nbytes: int, device: torch.device, owner) -> torch.Tensor:
    t = torch.as_tensor(_DeviceArray(ptr, nbytes), device=device)
    # keep the backend (which frees the memory) alive as long as any view exists
    weakref.finalize(t, lambda o: None, owner)
    return t
