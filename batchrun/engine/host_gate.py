"""A CUDA stream that waits for a host thread: work enqueued now, run once the host says so.

    gate = HostGate.create(device)           # where HostGate.available() (KernelPlan.host_gate)
    ticket = gate.next_ticket()
    start a job (another thread) that writes ...; then calls gate.open(ticket)
    gate.close(stream, ticket)               # the stream stops here ...
    ... enqueue work that reads what the job writes ...   # ... and runs on once it is open

Why: a grammar step's sampling needs a token bitmask that the fill job writes on the host while
the device runs the step's forward. Without a gate, the step loop has to wait for that job before
it may enqueue the sampling, and everything after it (the next forward, whose input ids the
sampling writes); on a busy host that wait left the GPU idle between steps. With a gate, the
sampling and the next forward are enqueued at once, like an unconstrained step's, and the device
waits only if the job is not done by the time the forward is.

The gate is `cuStreamWaitValue32` (a driver "stream memory operation", no SM time) on a pinned
host word: the stream waits until the word reaches the ticket; `open` is a plain store from the
host (x86 keeps the job's earlier stores, the bitmask, ahead of it). Tickets count up; the
comparison is cyclic, so they may wrap.

NOTE: a closed gate that nobody opens hangs the stream for good, and any host sync behind it:
close a gate only once the job that opens it runs, and have the job open it, error or not.
The order matters beyond that: a CUDA call may synchronize the device implicitly (the first
launch of a kernel, which loads its module, is one); made by the thread that would start the
job, between close and that start, it would never return.
"""

from __future__ import annotations

import ctypes
import functools
import threading

import torch

_WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0


@functools.cache
def _driver():
    """(libcuda, cuStreamWaitValue32) or None where the driver or the call is missing."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    wait_value = getattr(lib, "cuStreamWaitValue32_v2", None) or getattr(
        lib, "cuStreamWaitValue32", None
    )
    if wait_value is None:
        return None
    wait_value.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    wait_value.restype = ctypes.c_int
    return lib, wait_value


class HostGate:
    def __init__(self, device: torch.device, wait_value, device_ptr: int, flag: torch.Tensor):
        self.device = device
        self._wait_value = wait_value
        self._addr = device_ptr
        self._flag = flag  # keeps the pinned word alive
        self._word = ctypes.c_uint32.from_address(flag.data_ptr())
        self._ticket = 0
        self._lock = threading.Lock()  # open() may race with itself (jobs of two steps)

    @staticmethod
    def available() -> bool:
        """Whether the CUDA driver has the stream wait call a gate needs."""
        return _driver() is not None

    @classmethod
    def create(cls, device: torch.device) -> HostGate:
        """A gate on `device` (a CUDA device, with `available()`)."""
        lib, wait_value = _driver()
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        return cls(device, wait_value, _device_pointer(lib, flag), flag)

    def next_ticket(self) -> int:
        """A new ticket: for a job to open, and for close() once that job runs."""
        self._ticket = (self._ticket + 1) & 0xFFFFFFFF
        return self._ticket

    def close(self, stream: torch.cuda.Stream, ticket: int) -> None:
        """Make `stream` wait, from this point on, until open(ticket) (or a later ticket); if
        that happened already, the stream does not wait."""
        err = self._wait_value(stream.cuda_stream, self._addr, ticket, _WAIT_VALUE_GEQ)
        if err != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {err}")

    def open(self, ticket: int) -> None:
        """Let the stream run past close(stream, ticket) and every close with an earlier
        ticket; from any thread. Opening an older ticket than the last opened one changes
        nothing."""
        with self._lock:
            current = self._word.value
            # cyclic: only move forward
            if ((ticket - current) & 0xFFFFFFFF) < 0x80000000:
                self._word.value = ticket


def _device_pointer(lib, flag: torch.Tensor) -> int:
    """The device's address of a pinned host tensor. With unified addressing (every 64-bit CUDA
    process) it is the host address; the driver is asked first, in case it is not."""
    get = getattr(lib, "cuMemHostGetDevicePointer_v2", None)
    if get is not None:
        get.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]
        get.restype = ctypes.c_int
        out = ctypes.c_uint64(0)
        if get(ctypes.byref(out), flag.data_ptr(), 0) == 0 and out.value:
            return out.value
    return flag.data_ptr()
