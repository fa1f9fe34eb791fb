"""The blocks models are assembled from (an architecture's file picks them, models/registry.py):

    context.py     BuildContext: dtype, device, kernel plan, TP group and partition, the config
    attention.py   Attention: fused qkv, q/k norm, full or sliding window, sinks, o_proj
    gated_attention.py  GatedAttention: Attention with an output gate (Qwen3-Next, Qwen3.5)
    gated_deltanet.py   GatedDeltaNet: linear attention with a recurrent state a request
                   (engine/state_pool.py), on delta_rule.py's plain-torch recurrence
    mlp.py         GatedMLP (SiLU or GELU-tanh gate); experts_or_dense: the MoE (layers/moe.py)
                   with or without a shared expert
    layer.py       PreNormLayer, SandwichNormLayer: a layer as two halves around its attention
    model.py       CausalLM: (scaled) embeddings, layers, final norm, LM head; one forward

Room for what comes next, by the same seams: a layer is anything with `pre_attention` and
`post_attention` halves around a per-request state op that the model calls in between (a
recurrent-state mixer in place of `Attention.attend`, with its own pool beside the paged KV);
`Attention.layer_id` names the KV it reads and writes, so a layer may read another's; and a
model that ends in a pooling head replaces `CausalLM.logits`.
"""
