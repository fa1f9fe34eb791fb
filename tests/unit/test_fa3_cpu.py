"""FlashInfer's FA3 prefill on the CPU side: attention/fa3_cache.py (where its built kernels are,
the background build, the start-up batch) and attention/fa3_prefill.py's plumbing over a torch
stand-in for flashinfer (tests/gpu/test_fa3_prefill.py runs the real kernels)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from batchrun.attention import fa3_cache, fa3_prefill
from batchrun.attention.base import AttentionInputs
from batchrun.engine.kv_pool import KVPool

CPU = torch.device("cpu")


def test_modules_import_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # `import flashinfer` raises
    with pytest.raises(ImportError, match="flashinfer is not importable.*flashinfer-python"):
        fa3_cache.import_flashinfer()
    assert fa3_cache.unavailable_reason(CPU, 128, "auto", False, False) == "it needs a CUDA device"


def test_unavailable_reasons(monkeypatch):
    """What keeps FA3 from a model, built or not, once flashinfer imports on a GPU."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[0])
    cuda = torch.device("cuda")
    assert fa3_cache.unavailable_reason(cuda, 128, "auto", False, False) is None
    assert fa3_cache.unavailable_reason(cuda, 256, "bfloat16", False, False) is None
    assert "head dims" in fa3_cache.unavailable_reason(cuda, 80, "auto", False, False)
    assert "float32" in fa3_cache.unavailable_reason(cuda, 128, "float32", False, False)
    assert "float8" in fa3_cache.unavailable_reason(cuda, 128, "auto", True, False)
    assert "sinks" in fa3_cache.unavailable_reason(cuda, 64, "auto", False, True)
    capability[0] = (10, 0)
    assert "sm_90" in fa3_cache.unavailable_reason(cuda, 128, "auto", False, False)


def test_window_lefts():
    """One kernel a window kind: the whole context (-1) where a layer has no window, one
    windowed value where a layer has one (FlashInfer builds the two apart)."""
    assert fa3_cache.window_lefts((0,)) == [-1]
    assert fa3_cache.window_lefts(()) == [-1]
    assert fa3_cache.window_lefts((4096,) * 4) == [fa3_cache.PROBE_TOKENS - 1]
    assert fa3_cache.window_lefts((0, 8) * 2) == [-1, 7]


def _uri(backend, q, kv, o, idx, head_qk, head_vo, posenc, swa, cap, f16qk) -> str:
    """flashinfer 0.6's get_batch_prefill_uri, for the dtypes FA3 runs."""
    name = {torch.bfloat16: "bf16", torch.float16: "f16", torch.int32: "i32"}
    return (
        f"batch_prefill_with_kv_cache_dtype_q_{name[q]}_dtype_kv_{name[kv]}_dtype_o_{name[o]}_"
        f"dtype_idx_{name[idx]}_head_dim_qk_{head_qk}_head_dim_vo_{head_vo}_posenc_{posenc}_"
        f"use_swa_{swa}_use_logits_cap_{cap}_f16qk_{f16qk}" + ("_sm90" if backend == "fa3" else "")
    )


@pytest.fixture
def jit(monkeypatch, tmp_path):
    """A stand-in flashinfer.jit: its JIT cache and flashinfer-jit-cache's dir under tmp_path,
    and specs whose build writes the library where the JIT cache holds it."""
    aot, cache = tmp_path / "aot", tmp_path / "cache" / "0.6.14" / "90a" / "cached_ops"
    built = []

    class Spec:
        def __init__(self, name):
            self.name = name

        def get_library_path(self):
            return aot / self.name / f"{self.name}.so"

        @property
        def is_compiled(self):
            return (
                self.get_library_path().is_file()
                or (cache / self.name / f"{self.name}.so").is_file()
            )

        def build(self, verbose):
            (cache / self.name).mkdir(parents=True, exist_ok=True)
            (cache / self.name / f"{self.name}.so").write_bytes(b"")
            built.append(self.name)

    env = types.SimpleNamespace(FLASHINFER_AOT_DIR=aot, FLASHINFER_JIT_DIR=cache)
    module = types.SimpleNamespace(
        env=env,
        get_batch_prefill_uri=_uri,
        gen_batch_prefill_module=lambda *args: Spec(_uri(*args)),
    )
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(jit=module))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", module)
    return types.SimpleNamespace(aot=aot, cache=cache, built=built)


def test_missing_modules_reads_the_jit_cache_and_the_jit_cache_package(jit):
    """A module is built where its library is in flashinfer-jit-cache's dir or in the JIT cache
    (JitSpec.is_compiled's rule); a windowed model needs its windowed module too."""
    whole, windowed = fa3_cache.module_uris(128, torch.bfloat16, (0, 4096))
    assert whole.endswith("head_dim_qk_128_head_dim_vo_128_posenc_0_use_swa_False"
                          "_use_logits_cap_False_f16qk_False_sm90")  # fmt: skip
    assert "dtype_q_bf16_dtype_kv_bf16_dtype_o_bf16_dtype_idx_i32" in whole
    assert "use_swa_True" in windowed
    assert fa3_cache.missing_modules(128, torch.bfloat16, (0,)) == [whole]
    (jit.aot / whole).mkdir(parents=True)
    (jit.aot / whole / f"{whole}.so").write_bytes(b"")
    assert fa3_cache.missing_modules(128, torch.bfloat16, (0,)) == []
    assert fa3_cache.missing_modules(128, torch.bfloat16, (0, 4096)) == [windowed]
    (jit.cache / windowed).mkdir(parents=True)
    (jit.cache / windowed / f"{windowed}.so").write_bytes(b"")
    assert fa3_cache.missing_modules(128, torch.bfloat16, (0, 4096)) == []
    assert len(fa3_cache.missing_modules(128, torch.float16, (0,))) == 1  # another dtype


def test_build_builds_what_is_missing_once_at_a_time(jit, capsys):
    """`python -m batchrun.attention.fa3_cache` builds the model's modules into the JIT cache
    (after which none is missing); a second build while one holds the lock returns at once."""
    import fcntl

    fa3_cache.main(["--head-dim", "64", "--dtype", "float16", "--windows", "0,512"])
    assert len(jit.built) == 2
    assert fa3_cache.missing_modules(64, torch.float16, (0, 512)) == []
    fa3_cache.build(64, torch.float16, (0, 512))
    assert len(jit.built) == 2  # built already
    with open(jit.cache / fa3_cache.BUILD_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fa3_cache.build(128, torch.bfloat16, (0,))
    assert len(jit.built) == 2 and "another process builds" in capsys.readouterr().out


def test_start_build_detaches_a_process_without_the_gpu(monkeypatch):
    """The build runs in a session of its own (it outlives the run), sees no GPU (it takes no
    GPU memory from the engine) and is told the archs whose cache dir the engine reads."""
    seen = {}

    def popen(command, **kw):
        seen.update(command=command, **kw)

    monkeypatch.setattr(fa3_cache.subprocess, "Popen", popen)
    monkeypatch.setattr(fa3_cache, "cuda_arch_list", lambda: "9.0")
    monkeypatch.delenv("FLASHINFER_CUDA_ARCH_LIST", raising=False)
    log_path = fa3_cache.start_build(128, torch.bfloat16, (0, 4096))
    assert log_path.is_file()
    log_path.unlink()
    assert seen["command"][1:] == [
        "-m", "batchrun.attention.fa3_cache", "--head-dim", "128", "--dtype", "bfloat16",
        "--windows", "0,4096",
    ]  # fmt: skip
    assert seen["start_new_session"] and seen["stdin"] is fa3_cache.subprocess.DEVNULL
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert seen["env"]["FLASHINFER_CUDA_ARCH_LIST"] == "9.0"


def test_find_nvcc(monkeypatch, tmp_path):
    """nvcc as torch's extension builder finds it: CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda."""
    monkeypatch.setattr(fa3_cache.shutil, "which", lambda name: None)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    isfile = fa3_cache.os.path.isfile
    monkeypatch.setattr(
        fa3_cache.os.path, "isfile", lambda p: p.startswith(str(tmp_path)) and isfile(p)
    )
    assert fa3_cache.find_nvcc() is None
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert fa3_cache.find_nvcc() == str(tmp_path / "bin" / "nvcc")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setattr(fa3_cache.shutil, "which", lambda name: str(tmp_path / "bin" / "nvcc"))
    assert fa3_cache.find_nvcc() == str(tmp_path / "bin" / "nvcc")


def test_probe_error_plans_and_runs_as_fa3_prefill_does(monkeypatch):
    """probe_error against a stand-in flashinfer: the wrapper on the "fa3" backend, planned
    causal over page size 1 with the heads and dtypes given, run on a (k, v) pair, once a
    window kind; a failure comes back as its type and last lines."""
    seen = {}

    class Wrapper:
        def __init__(self, workspace, layout, backend):
            seen["init"] = (layout, backend)

        def plan(self, *args, **kw):
            seen["plan"] = (args[4:], kw)
            seen.setdefault("lefts", []).append(kw["window_left"])

        def run(self, q, kv):
            if seen.get("fail"):
                raise RuntimeError("CUDA error\n\nan illegal instruction was encountered\n")
            seen["kv"] = kv[0].shape
            return torch.empty_like(q)

    stub = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=Wrapper)
    monkeypatch.setattr(fa3_cache, "import_flashinfer", lambda: stub)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert fa3_cache.probe_error(CPU, 32, 8, 128, torch.bfloat16) is None
    assert seen["init"] == ("NHD", "fa3")
    assert seen["plan"][0] == (32, 8, 128, 1)
    assert seen["plan"][1]["causal"] and seen["plan"][1]["window_left"] == -1
    assert seen["plan"][1]["q_data_type"] == seen["plan"][1]["kv_data_type"] == torch.bfloat16
    assert seen["kv"] == (fa3_cache.PROBE_TOKENS, 1, 8, 128)
    seen["lefts"] = []
    assert fa3_cache.probe_error(CPU, 32, 8, 128, torch.bfloat16, (0, 8) * 2) is None
    assert seen["lefts"] == [-1, 7]
    seen["fail"] = True
    error = fa3_cache.probe_error(CPU, 32, 8, 128, torch.bfloat16)
    assert error == "RuntimeError: CUDA error / an illegal instruction was encountered"


# ---- FA3Prefill's plumbing over a stand-in for flashinfer -------------------------------------
# The stand-in follows flashinfer 0.6's documented contract (page table in CSR form, NHD pages,
# causal mask aligned bottom-right) in plain torch: it checks what FA3Prefill hands to plan()
# and when it plans, not the kernels.


class _Prefill:
    def __init__(self, workspace, kv_layout, backend):
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8 and backend == "fa3"
        self.num_plans = 0

    def plan(self, qo_indptr, indptr, indices, last_page_len, num_qo_heads, num_kv_heads,
             head_dim, page_size, *, causal, q_data_type, kv_data_type, sm_scale,
             non_blocking, window_left=-1):  # fmt: skip
        assert causal and page_size == 1 and (last_page_len == 1).all()
        for host in (qo_indptr, indptr, last_page_len):  # host tensors: plan() does not sync
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert indices.dtype == torch.int32 and len(indices) == int(indptr[-1])
        if self.num_plans:  # flashinfer compiles a wrapper's kernels for its window kind
            assert (window_left >= 0) == (self.window_left >= 0), "a wrapper keeps its window"
        self.window_left = window_left
        self.state = (qo_indptr, indptr, indices, sm_scale)
        self.num_plans += 1

    def run(self, q, paged_kv, out):
        qo_indptr, kv_indptr, kv_indices, scale = self.state
        k_cache, v_cache = paged_kv  # [P, 1, KV, D]
        group = q.shape[1] // k_cache.shape[2]
        for b in range(len(kv_indptr) - 1):
            pages = kv_indices[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            keys = k_cache[pages, 0].float().repeat_interleave(group, 1)  # [S, H, D]
            values = v_cache[pages, 0].float().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qs:qe].float(), keys) * scale
            n, s = qe - qs, len(pages)
            k_pos, q_pos = torch.arange(s)[None, :], torch.arange(s - n, s)[:, None]
            visible = k_pos <= q_pos  # bottom-right
            if self.window_left >= 0:  # keys q_pos - window_left <= k <= q_pos
                visible &= k_pos >= q_pos - self.window_left
            scores = scores.masked_fill(~visible, float("-inf"))
            out[qs:qe] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Prefill)
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(fa3_prefill, "WORKSPACE_BYTES", 1024)


def _batch(seq_lens, extend_lens, num_heads, num_kv_heads, head_dim=64, seed=0):
    """A 2-layer fp16 pool holding shuffled prefixes and the new tokens' KV, and their q."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = sum(seq_lens) + 5
    pool = KVPool(2, num_slots, num_kv_heads, head_dim, torch.float16, "cpu")
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    table = torch.zeros(len(seq_lens) + 3, max(seq_lens) + 4, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)]
    perm, start = torch.randperm(num_slots, generator=gen), 0
    for row, seq_len in zip(rows.tolist(), seq_lens):
        table[row, :seq_len] = perm[start : start + seq_len].int()
        start += seq_len
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).half()
    inputs = AttentionInputs(
        req_pool_indices=rows.long(),
        seq_lens=torch.tensor(seq_lens),
        extend_lens=torch.tensor(extend_lens),
        out_cache_loc=torch.zeros(sum(extend_lens), dtype=torch.long),  # (not read: stored)
        seq_lens_cpu=tuple(seq_lens),
        extend_lens_cpu=tuple(extend_lens),
    )
    return pool, table, inputs, q


def _reference(pool, table, inputs, q, layer_id, scaling, window=0):
    """The torch backend's attention over the pool as it is (the new KV stored already)."""
    from batchrun.attention.torch_backend import TorchAttentionBackend

    num_kv_heads = pool.k_buffers[0].shape[1]
    ref_pool = KVPool(2, pool.num_slots, num_kv_heads, q.shape[2], torch.float32, "cpu")
    for src, dst in zip(pool.k_buffers + pool.v_buffers, ref_pool.k_buffers + ref_pool.v_buffers):
        dst.copy_(src)
    backend = TorchAttentionBackend(ref_pool, table)
    backend.prepare(inputs)
    k_buf, v_buf = ref_pool.buffers(layer_id)
    return backend._attend(q.float(), k_buf, v_buf, scaling, window, None)


def test_gather_kv_indices():
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 1000, (6, 40), generator=gen)
    rows, seq_lens = [4, 0, 2, 5], [1, 40, 7, 13]
    expected = torch.cat([table[r, :n] for r, n in zip(rows, seq_lens)]).int()
    got = fa3_prefill.gather_kv_indices(
        table, torch.tensor(rows), torch.tensor(seq_lens), sum(seq_lens)
    )
    assert got.dtype == torch.int32 and torch.equal(got, expected)


@pytest.mark.parametrize(
    "seq_lens, extend_lens", [([30, 12], [30, 5]), ([50, 8, 20], [4, 8, 3])], ids=["a", "b"]
)
@pytest.mark.parametrize("window", [0, 8], ids=["whole", "window8"])
def test_extend_rows_over_stand_in(fake_flashinfer, seq_lens, extend_lens, window):
    """Each window's wrapper is planned once a step (window_left W - 1) and shared by the
    layers; the output is the torch backend's."""
    pool, table, inputs, q = _batch(seq_lens, extend_lens, 8, 2)
    prefill = fa3_prefill.FA3Prefill(pool, table)
    for step in range(2):
        prefill.prepare(inputs)
        for layer_id in (0, 1):
            out = torch.empty_like(q)
            got = prefill.attend(q, layer_id, 0.1, out, window)
            ref = _reference(pool, table, inputs, q, layer_id, 0.1, window)
            assert got.shape == (len(q), 8 * 64)
            assert (got.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
        [(wrapper, _)] = prefill._planned.values()
        assert wrapper.num_plans == step + 1 and wrapper.window_left == window - 1


def test_refuses_a_float32_pool(fake_flashinfer):
    pool = KVPool(1, 8, 2, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="float16 or bfloat16 KV pool"):
        fa3_prefill.FA3Prefill(pool, torch.zeros(2, 4, dtype=torch.int32))
