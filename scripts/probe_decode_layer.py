"""Where a one-row llama-8b decode layer's time goes, program by program: %globaltimer probes
inside the kernels, in a CUDA graph of --layers layers chained with PDL as the engine runs them.

    python scripts/probe_decode_layer.py                    # the engine's defaults ("fold-all")
    python scripts/probe_decode_layer.py --post-norm        # o_proj's norm tail, gate_up plain

Patched copies of kernels/gemv.py and kernels/decode_attention.py (the edits below, made on the
source text; each anchor must occur once, so a kernel change that moves one fails loudly here and
in tests/unit/test_probe_decode_layer.py) store, per program, the global timer (and the SM's
clock) at its entry, after its PDL wait, after its main work and at its exit; the decode
attention also after its q / k / v loads, after its attention, after its split counter and, in
the last split, after the combine. Printed: each kernel's added time in the chain (its last
program's end after the last end of the kernel before it, mean over the layers after the
first), and the attention's steps in the middle layer. The timer ticks in ~0.26 µs on the H200.

Found this way (fourteenth session): the attention's combine loaded its heads one after another
(~4 µs of 11), and the qkv matmul's 96 programs kept too few bytes in flight (2.6 TB/s).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# NOTE: slots of 16 int64 a program: (timer, clock) for probes 0-6, the SM id at 14
PROBE_HELPER = '''
@triton.jit
def _probe(Probe, pid, i: tl.constexpr, dep):
    """The global timer and the SM clock into probe slot i of program pid, once dep (a scalar)
    is computed: the asm takes it as an operand, so it waits for the loads behind it."""
    d = dep.to(tl.float32)
    t = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l,f", [d], dtype=tl.int64, is_pure=False, pack=1
    )
    c = tl.inline_asm_elementwise(
        "mov.u64 $0, %clock64;", "=l,f", [d], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(Probe + pid * 16 + i * 2, t)
    tl.store(Probe + pid * 16 + i * 2 + 1, c)
    if i == 0:
        sm = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r,f", [d], dtype=tl.int32, is_pure=False, pack=1
        )
        tl.store(Probe + pid * 16 + 14, sm.to(tl.int64))

'''
PROBE_SLOTS = 16

# (anchor, replacement): gemv's probes 0 entry, 1 after the wait, 2 after the loop, 3 exit
GEMV_EDITS = [
    ("    PEEL: tl.constexpr,\n):", "    PEEL: tl.constexpr,\n    Probe,\n):"),
    (
        "    pid_k = tl.program_id(1)\n",
        "    pid_k = tl.program_id(1)\n    _pid = pid_n + pid_k * tl.num_programs(0)\n"
        "    _probe(Probe, _pid, 0, _pid)\n",
    ),
    (
        "    pdl_wait(PDL)\n    res = tl.zeros",
        "    pdl_wait(PDL)\n    _probe(Probe, _pid, 1, _pid)\n    res = tl.zeros",
    ),
    (
        "    if NORM_IN:  # rmsnorm(x) * g @ w.T",
        "    _probe(Probe, _pid, 2, tl.sum(acc))\n    if NORM_IN:  # rmsnorm(x) * g @ w.T",
    ),
    (
        "                )\n\n\n# NOTE: K-split programs",
        "                )\n    _probe(Probe, _pid, 3, _pid)\n\n\n# NOTE: K-split programs",
    ),
    (
        "**pdl,\n    )  # fmt: skip\n    return y, normed",
        "**pdl, Probe=PROBE[0],\n    )\n    return y, normed",
    ),
]
# the decode attention's: 0 entry, 1 after the wait, 2 q / k / v rotated, 3 attended, 4 counted,
# 5 combined (the last split), 6 exit
ATTENTION_EDITS = [
    (
        '    EVICT: tl.constexpr,  # the KV loads\' L2 eviction policy ("" for the default)\n):',
        '    EVICT: tl.constexpr,  # the KV loads\' L2 eviction policy ("" for the default)\n'
        "    Probe,\n):",
    ),
    (
        "    split = tl.program_id(2)\n",
        "    split = tl.program_id(2)\n"
        "    _pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1))"
        " * tl.num_programs(2) + split\n"
        "    _probe(Probe, _pid, 0, _pid)\n",
    ),
    (
        "        pdl_wait(PDL)\n        q = _rope_rows(",
        "        pdl_wait(PDL)\n        _probe(Probe, _pid, 1, _pid)\n        q = _rope_rows(",
    ),
    (
        "        v_new = v_new[None, :]\n",
        "        v_new = v_new[None, :]\n        _probe(Probe, _pid, 2, tl.sum(q.to(tl.float32))"
        " + tl.sum(k_new.to(tl.float32)) + tl.sum(v_new.to(tl.float32)))\n",
    ),
    (
        "    l_safe = tl.where(l_i > 0.0, l_i, 1.0)\n    if DIRECT:",
        "    l_safe = tl.where(l_i > 0.0, l_i, 1.0)\n    _probe(Probe, _pid, 3, tl.sum(acc))\n"
        "    if DIRECT:",
    ),
    (
        "HEAD_DIM, BLOCK_G, BLOCK_S, BLOCK_D,\n            )  # fmt: skip\n",
        "HEAD_DIM, BLOCK_G, BLOCK_S, BLOCK_D, Probe, _pid,\n            )\n"
        "    _probe(Probe, _pid, 6, _pid)\n",
    ),
    (
        '    BLOCK_D: tl.constexpr,\n):\n    """Count this split',
        '    BLOCK_D: tl.constexpr,\n    Probe,\n    _pid,\n):\n    """Count this split',
    ),
    (
        '    done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")\n',
        '    done_before = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")\n'
        "    _probe(Probe, _pid, 4, done_before)\n",
    ),
    (
        '        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")\n\n\n@triton.jit\n'
        "def _combine_head",
        "        _probe(Probe, _pid, 5, tl.sum(out))\n"
        '        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")\n\n\n@triton.jit\n'
        "def _combine_head",
    ),
    (
        "        EVICT=evict,\n    )",
        "        EVICT=evict,\n        Probe=PROBE[0],\n    )",
    ),
]
KERNELS = {"gemv": ("kernels/gemv.py", GEMV_EDITS), "attention": ("kernels/decode_attention.py",
                                                                  ATTENTION_EDITS)}  # fmt: skip


def patched_source(kind: str) -> str:
    """kernels/<kind>'s source with the probes in: the edits, the helper before the first
    jit function, and PROBE, the probe buffer the next launch passes (a list to set it in)."""
    path, edits = KERNELS[kind]
    src = (ROOT / path).read_text()
    for old, new in edits:
        count = src.count(old)
        assert count == 1, f"{path}: a probe's anchor occurs {count} times: {old!r}"
        src = src.replace(old, new)
    src = src.replace("\n@triton.jit\n", PROBE_HELPER + "\n@triton.jit\n", 1)
    return src + "\nPROBE = [None]\n"


def load_patched(kind: str, tmp: Path):
    """The patched module (Triton's jit reads its functions' source from a file)."""
    path = tmp / f"probed_{kind}.py"
    path.write_text(patched_source(kind))
    spec = importlib.util.spec_from_file_location(f"probed_{kind}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


NAMES = ("qkv", "attention", "o_proj", "gate_up", "down_proj")
EXIT = {"attention": 6}  # the probe each kernel exits at (gemv: 3)


def build_layers(n: int, dev):
    """n layers of llama-8b's decoder weights (random bf16: the probes time the kernels, not the
    numbers; qkv and gate_up stand for their folded copies) and KV pools of 2,048 slots."""
    hidden, inter, kv_heads, head_dim, scale = 4096, 14336, 8, 128, 0.02
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    return [
        dict(
            qkv=torch.randn(6144, hidden, **bf16) * scale,
            o=torch.randn(hidden, hidden, **bf16) * scale,
            gate_up=torch.randn(2 * inter, hidden, **bf16) * scale,
            down=torch.randn(hidden, inter, **bf16) * scale,
            norm=torch.ones(hidden, **bf16),
            k=torch.randn(2048, kv_heads, head_dim, **bf16),
            v=torch.randn(2048, kv_heads, head_dim, **bf16),
        )
        for _ in range(n)
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=700, help="KV tokens, the new one included")
    p.add_argument("--splits", type=int, default=16, help="decode attention's KV splits")
    p.add_argument(
        "--post-norm",
        action="store_true",
        help='the post-attention norm in o_proj\'s tail ("fold"), not in gate_up',
    )
    p.add_argument("--out", type=Path, help="save the raw probes here (torch.save)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_decode_layer needs a CUDA GPU")
        return 1
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        gemv_mod = load_patched("gemv", Path(tmp))
        attn_mod = load_patched("attention", Path(tmp))
        probes = run(args, dev, gemv_mod, attn_mod)
    if args.out:
        torch.save(probes, args.out)
    report(probes)
    return 0


def run(args, dev, G, D) -> torch.Tensor:
    """The layers' graph, replayed; the last replay's probes [layers, 5 kernels, 512, 16]."""
    layers = build_layers(args.layers, dev)
    heads, kv_heads, head_dim, ctx = 32, 8, 128, args.context
    table = torch.zeros(2, 4096, dtype=torch.int32, device=dev)
    table[0, :ctx] = torch.arange(ctx, dtype=torch.int32, device=dev)
    row = torch.zeros(1, dtype=torch.int64, device=dev)
    seq_lens = torch.full((1,), ctx, dtype=torch.int64, device=dev)
    newest = torch.full((1,), ctx - 1, dtype=torch.int64, device=dev)
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    angles = torch.outer(torch.arange(8192, device=dev).float(), inv)
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos(), angles.sin()
    workspace = torch.empty(
        D.decode_workspace_numel(1, heads, head_dim, args.splits), dtype=torch.float32, device=dev
    )
    counters = D.decode_counters(1, kv_heads, dev)
    probes = torch.zeros(args.layers, 5, 512, PROBE_SLOTS, dtype=torch.int64, device=dev)
    h0 = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    outs = [torch.empty(1, heads, head_dim, device=dev, dtype=torch.bfloat16) for _ in layers]

    def forward():
        h = h0
        for i, w in enumerate(layers):
            G.PROBE[0] = probes[i, 0]
            qkv = G.gemv_rms(h, w["qkv"], 1e-5)
            q = qkv[:, : heads * head_dim].view(1, heads, head_dim)
            k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(1, kv_heads, head_dim)
            v = qkv[:, (heads + kv_heads) * head_dim :].view(1, kv_heads, head_dim)
            D.PROBE[0] = probes[i, 1]
            rope = D.DecodeRope(k, v, newest, newest, cos, sin)
            D.decode_attention_fwd(q, w["k"], w["v"], outs[i], table, row, seq_lens, 0.088,
                                   args.splits, workspace, counters, rope=rope)  # fmt: skip
            G.PROBE[0] = probes[i, 2]
            attn = outs[i].view(1, heads * head_dim)
            if args.post_norm:
                h, normed = G.gemv_residual(attn, w["o"], h, norm=(w["norm"], 1e-5))
                G.PROBE[0] = probes[i, 3]
                act = G.gemv(normed, w["gate_up"], swiglu=True)
            else:
                h = G.gemv_residual(attn, w["o"], h).h
                G.PROBE[0] = probes[i, 3]
                act = G.gemv_rms(h, w["gate_up"], 1e-5, swiglu=True)
            G.PROBE[0] = probes[i, 4]
            h = G.gemv_residual(act, w["down"], h).h
        return h

    forward()  # compiles; the split counters exist before the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
        with torch.cuda.graph(graph, stream=stream):
            forward()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_layer = start.elapsed_time(end) / 50 * 1000 / args.layers
    print(f"{args.layers} layers: {per_layer:.2f} µs a layer (graph replays, probes in)")
    probes.zero_()
    graph.replay()
    torch.cuda.synchronize()
    return probes.cpu()


def report(probes: torch.Tensor) -> None:
    """Each kernel's added time in the chain; the middle layer's attention step by step."""
    num_layers = probes.shape[0]
    ran = [probes[0, k, :, 0] > 0 for k in range(5)]  # the programs each kernel launched

    def times(layer, k, i):  # µs
        return probes[layer, k, ran[k], 2 * i].double() / 1e3

    added = {name: [] for name in NAMES}
    for layer in range(1, num_layers):
        prev = times(layer - 1, 4, 3).max()
        for k, name in enumerate(NAMES):
            last = times(layer, k, EXIT.get(name, 3)).max()
            added[name].append((last - prev).item())
            prev = last
    print("| kernel | programs | adds µs a layer |\n|---|---:|---:|")
    for k, name in enumerate(NAMES):
        print(f"| {name} | {int(ran[k].sum())} | {sum(added[name]) / len(added[name]):.2f} |")
    total = sum(sum(v) / len(v) for v in added.values())
    print(f"| layer | | {total:.2f} |")
    mid = num_layers // 2
    wait = times(mid, 1, 1)
    print(f"\nattention, layer {mid}, µs after its first program's wait (min / median / max):")
    for label, i in (("wait", 1), ("q, k, v rotated", 2), ("attended", 3), ("counted", 4),
                     ("exit", 6)):  # fmt: skip
        t = times(mid, 1, i) - wait.min()
        print(f"  {label}: {t.min():.2f} / {t.median():.2f} / {t.max():.2f}")
    combined = probes[mid, 1, ran[1], 10] > 0  # slot 5: the last split of each KV head
    if combined.any():
        t = probes[mid, 1, ran[1], 10][combined].double() / 1e3 - wait.min()
        print(f"  combined (last splits): {t.min():.2f} / {t.max():.2f}")


if __name__ == "__main__":
    sys.exit(main())
