"""The decoder's building blocks, shared by every architecture: norms, rotary, linear layers.

    norm.py     RMSNorm (with the residual add fused on the GPU)
    rotary.py   rotary embedding (default, linear and llama3 scaling)
    linear.py   linear layers, tensor-parallel (column, row, vocab); decode matmuls on
                kernels/gemv.py where the kernel plan says so

Every block takes the resolved KernelPlan (batchrun/config.py) at construction and runs the
Triton kernels it names, or plain PyTorch (KernelPlan.reference(): the CPU's path).
"""
