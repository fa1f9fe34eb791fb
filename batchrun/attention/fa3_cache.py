"""Whether FlashInfer's FA3 prefill (fa3_prefill.py) can run a model here without a compiler on
the start-up path, and the background build that makes it run on the next start.

FlashInfer (0.6) compiles each prefill variant (q / kv / o dtype, head dim, sliding window or
not) with nvcc into a JIT module named by `flashinfer.jit.get_batch_prefill_uri`. The module is
built when its library is in the flashinfer-jit-cache package (`flashinfer.jit.env.
FLASHINFER_AOT_DIR`) or in the JIT cache (`FLASHINFER_JIT_DIR`: ~/.cache/flashinfer/<version>/
<archs>/cached_ops, under FLASHINFER_WORKSPACE_BASE if set), as `JitSpec.is_compiled` reads it:

    missing = missing_modules(head_dim, dtype, windows)   # [] where every variant is built
    if missing: start_build(...)                           # a detached process; returns at once

    python -m batchrun.attention.fa3_cache --head-dim 128 --dtype bfloat16 --windows 0
                                                           # what start_build runs

Nothing here compiles in the engine's process; the build runs niced, in a session of its own
(it outlives the run that started it), and one build at a time a cache (a lock file).
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128, 256)
DTYPES = (torch.float16, torch.bfloat16)
PROBE_TOKENS = 16
BUILD_LOCK = "batchrun-fa3-build.lock"  # in the JIT cache dir: one build at a time


def import_flashinfer():
    """The flashinfer module, or ImportError saying what is wrong."""
    try:
        import flashinfer
    except Exception as e:  # ImportError, or an install that does not match torch / CUDA
        raise ImportError(
            f"flashinfer is not importable ({type(e).__name__}: {e}); install flashinfer-python "
            "for this torch and CUDA"
        ) from e
    return flashinfer


def unavailable_reason(device, head_dim: int, dtype: str, kv_fp8: bool, sinks: bool):
    """Why FlashInfer's FA3 prefill cannot run a model's extend rows on `device`, built or not
    (None: it can once built). dtype: EngineConfig.dtype ("auto": bf16 on CUDA)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "it needs a CUDA device"
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.cuda.get_device_capability(index)[0] != 9:
        return "FlashInfer's FA3 kernels run on sm_90 GPUs (H100, H200) only"
    if head_dim not in HEAD_DIMS:
        return f"they support head dims {HEAD_DIMS}, and this model's is {head_dim}"
    if dtype not in ("auto", "bfloat16", "float16"):
        return f"they run in bfloat16 or float16, and this run's dtype is {dtype}"
    if kv_fp8:
        return "they read a bf16 / fp16 KV cache with bf16 / fp16 queries, not a float8 one"
    if sinks:
        return "they run no attention sinks, which this model has"
    try:
        import_flashinfer()
    except ImportError as e:
        return str(e)
    return None


def torch_dtype(dtype: str) -> torch.dtype:
    """EngineConfig.dtype as FA3 runs it ("auto": bf16, as the CUDA engine runs)."""
    return torch.float16 if dtype == "float16" else torch.bfloat16


def window_lefts(windows) -> list[int]:
    """FlashInfer's window_left of each kernel a model's windows need (FlashInfer builds the
    windowed kernel apart): -1 for the whole context where a layer has no window (0), and one
    windowed value (W - 1, at most PROBE_TOKENS - 1) where a layer has one."""
    windowed = [w for w in windows if w > 0]
    lefts = [-1] if 0 in windows or not windows else []
    return lefts + ([min(windowed[0], PROBE_TOKENS) - 1] if windowed else [])


def module_uris(head_dim: int, dtype: torch.dtype, windows) -> list[str]:
    """The JIT modules FA3Prefill loads for this model: one a window kind (whole, windowed)."""
    from flashinfer.jit import get_batch_prefill_uri

    args = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0)  # posenc 0: none
    return [
        get_batch_prefill_uri("fa3", *args, left >= 0, False, False)  # swa, soft cap, f16 qk
        for left in window_lefts(windows)
    ]


def library_dirs() -> list[Path]:
    """Where flashinfer looks for a built module: the flashinfer-jit-cache package's dir, then
    its JIT cache."""
    from flashinfer.jit import env

    return [Path(env.FLASHINFER_AOT_DIR), Path(env.FLASHINFER_JIT_DIR)]


def missing_modules(head_dim: int, dtype: torch.dtype, windows) -> list[str]:
    """The JIT modules of module_uris whose library is in no dir of library_dirs."""
    dirs = library_dirs()
    return [
        uri
        for uri in module_uris(head_dim, dtype, windows)
        if not any((d / uri / f"{uri}.so").is_file() for d in dirs)
    ]


def find_nvcc() -> str | None:
    """nvcc as torch's extension builder (and flashinfer) finds it: CUDA_HOME, CUDA_PATH,
    PATH, /usr/local/cuda."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [shutil.which("nvcc")] + [os.path.join(h, "bin", "nvcc") for h in homes if h]
    return next((n for n in candidates if n and os.path.isfile(n)), None)


def cuda_arch_list() -> str:
    """This process's GPUs as FLASHINFER_CUDA_ARCH_LIST ("9.0"): the build process sees no GPU
    (it must not take GPU memory from the engine) and names its cache dir by these archs."""
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return " ".join(f"{major}.{minor}" for major, minor in sorted(caps))


def start_build(head_dim: int, dtype: torch.dtype, windows) -> Path:
    """Start the build of the model's FA3 modules in a detached, niced process and return its
    log's path; the caller does not wait."""
    fd, log_path = tempfile.mkstemp(prefix="batchrun-fa3-build-", suffix=".log")
    env = dict(os.environ)
    env.setdefault("FLASHINFER_CUDA_ARCH_LIST", cuda_arch_list())
    env["CUDA_VISIBLE_DEVICES"] = ""
    dtype_name = "float16" if dtype == torch.float16 else "bfloat16"
    command = [
        sys.executable, "-m", "batchrun.attention.fa3_cache", "--head-dim", str(head_dim),
        "--dtype", dtype_name, "--windows", ",".join(str(w) for w in windows or (0,)),
    ]  # fmt: skip
    subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, env=env, start_new_session=True
    )
    os.close(fd)
    return Path(log_path)


def probe_error(device, num_heads: int, num_kv_heads: int, head_dim: int, dtype, windows=(0,)):
    """FlashInfer's FA3 prefill run on a PROBE_TOKENS-token causal batch with a model's heads
    (one rank's) and dtype, as FA3Prefill plans and runs it, once a kernel of window_lefts:
    None when they ran, else the error. Call only where missing_modules is empty: it loads the
    built modules (a module that fails to load or launch fails here, at start-up)."""
    fi = import_flashinfer()
    device, n = torch.device(device), PROBE_TOKENS
    try:
        workspace = torch.zeros(16 << 20, dtype=torch.uint8, device=device)
        indptr = torch.tensor([0, n], dtype=torch.int32)
        indices = torch.arange(n, dtype=torch.int32, device=device)
        last_page_len = torch.ones(1, dtype=torch.int32)
        q = torch.zeros((n, num_heads, head_dim), dtype=dtype, device=device)
        kv = torch.zeros((n, 1, num_kv_heads, head_dim), dtype=dtype, device=device)
        for window_left in window_lefts(windows):
            wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
            wrapper.plan(
                indptr, indptr, indices, last_page_len, num_heads, num_kv_heads, head_dim, 1,
                causal=True, q_data_type=dtype, kv_data_type=dtype, sm_scale=head_dim**-0.5,
                window_left=window_left,
            )  # fmt: skip
            out = wrapper.run(q, (kv, kv))
            torch.cuda.synchronize(device)
            if out.shape != q.shape:
                return f"it returned {tuple(out.shape)} for a query of {tuple(q.shape)}"
    except Exception as e:  # a failed load or launch: its message is the reason
        lines = [line for line in str(e).splitlines() if line.strip()]
        return f"{type(e).__name__}: {' / '.join(lines[-3:])[:600]}"
    return None


def build(head_dim: int, dtype: torch.dtype, windows) -> None:
    """Build the model's FA3 modules into flashinfer's JIT cache (nvcc); one build at a time a
    cache dir, a second caller returns at once."""
    from flashinfer.jit import env, gen_batch_prefill_module

    jit_dir = Path(env.FLASHINFER_JIT_DIR)
    jit_dir.mkdir(parents=True, exist_ok=True)
    with open(jit_dir / BUILD_LOCK, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"another process builds into {jit_dir}", flush=True)
            return
        for left in window_lefts(windows):
            args = (dtype, dtype, dtype, torch.int32, head_dim, head_dim, 0)  # as module_uris
            spec = gen_batch_prefill_module("fa3", *args, left >= 0, False, False)
            if not spec.is_compiled:
                print(f"building {spec.name}", flush=True)
                spec.build(verbose=False)
            print(f"built {spec.get_library_path()}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=build.__doc__)
    parser.add_argument("--head-dim", type=int, required=True, choices=HEAD_DIMS)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--windows", default="0", help="the model's sliding windows, 0: none")
    args = parser.parse_args(argv)
    windows = tuple(int(w) for w in args.windows.split(","))
    build(args.head_dim, torch_dtype(args.dtype), windows)


if __name__ == "__main__":
    os.nice(10)  # the engine's host loop comes first
    main()
