"""batchrun's Triton kernels, installed as `batchrun.kernels` (pyproject.toml maps this folder).

    decode_attention   flash-decoding over the paged KV, split combine in the same kernel
    extend_attention   prefill / extend attention over the paged KV
    gemv               decode matmuls (M <= 16): split-K, SwiGLU epilogue, residual + RMSNorm
    int4_matmul        W4A16 matmul of INT4 checkpoints (AWQ, GPTQ, W4A16): decode and prefill
    int4_gemv          W4A16 decode matmuls (M <= 16): split-K, SwiGLU epilogue, PDL
    fp8_gemv           FP8 decode matmuls (M <= 16), the per-token activation quantization inside
    fused_norm         RMSNorm, residual add + RMSNorm
    fused_rotary       rotary embedding in place
    kv_store           the KV store; rotary_kv_store: rotary and the KV store in one kernel
    activation         SwiGLU gate (silu(gate) * up)
    argmax             greedy sampling's argmax over the vocabulary
    token_bitmask      structured output's token bitmask (apply, masked argmax)
    graph_inputs       a decode CUDA graph's inputs in one kernel
    fp8_quant          FP8 activation quantization (per token, per token group, static)
    fp8_block_matmul   block-wise FP8 matmul (128 x 128 weight blocks) on the FP8 tensor cores
    moe_route          an MoE router's softmax, top-k and renormalization in one kernel
    moe_align          an MoE layer's routed tokens sorted and block-aligned by expert
    fused_moe          an MoE layer's experts: grouped GEMMs, SiLU gate and routing weights fused
    pdl                programmatic dependent launch helpers

Each module imports triton at its top: import them only where Triton is installed
(engine/kernel_choice.py turns every Triton path off where it is not).
"""
