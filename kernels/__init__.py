"""batchrun's Triton kernels, installed as `batchrun.kernels` (pyproject.toml maps this folder).

    decode_attention   flash-decoding over the paged KV, split combine in the same kernel
    extend_attention   prefill / extend attention over the paged KV
    gemv               decode matmuls (M <= 16): split-K, SwiGLU epilogue, residual + RMSNorm
    fp8_gemv           FP8 decode matmuls (M <= 16), the per-token activation quantization inside
    fp8_quant          FP8 activation quantization (per token, per token group, static)
    int4_matmul        W4A16 matmul of INT4 checkpoints (AWQ, GPTQ, W4A16): decode and prefill
    int4_gemv_mma      W4A16 decode matmuls (M <= 16) on the tensor cores, in Gluon
    fused_norm         RMSNorm, residual add + RMSNorm, Qwen3's per-head q / k norms
    fused_rotary       rotary embedding in place
    kv_store           the KV store
    rotary_kv_store    rotary and the KV store in one kernel
    activation         SwiGLU gate (silu(gate) * up)
    argmax             greedy sampling's argmax over the vocabulary
    token_bitmask      structured output's token bitmask (apply, masked argmax)
    graph_inputs       a decode CUDA graph's inputs in one kernel
    moe_route          an MoE router's softmax, top-k and renormalization in one kernel
    moe_align          an MoE layer's routed tokens sorted and block-aligned by expert
    fused_moe          an MoE layer's experts: grouped GEMMs, SiLU gate and routing weights fused
    fused_moe_tma      fused_moe's grouped GEMMs with both operands read through TMA descriptors
    moe_gemv           an MoE decode batch's experts as GEMVs (the router in moe_route)
    moe_grouped_mm     an MoE layer's prefill experts on torch._grouped_mm, with its gather / sum
    causal_conv1d      a hybrid model's causal conv1d, packed requests, conv states in place
    host_gather        rows of a table in pinned host memory gathered by the GPU (Gemma 4's
                       per-layer embeddings)
    tile_fit           attention tiles fitted to the device's shared memory (no kernel: the rule)
    pdl                programmatic dependent launch helpers

Each module imports triton at its top: import them only where Triton is installed
(engine/kernel_choice.py turns every Triton path off where it is not).
"""
