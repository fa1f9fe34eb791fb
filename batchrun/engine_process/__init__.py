"""The engine in its own process.

    client.py         EngineProcess: the main process's side (the engine surface, over a pipe)
    worker.py         the engine process's loop
    messages.py       what the two say to each other (msgspec, batched both ways)
    notify.py         how finished completions are batched into messages
    data_parallel.py  DataParallelEngine: one engine process per GPU, fed from one reader
    tp_launcher.py    start_tp_engine: a tensor-parallel group of engines, one per GPU
    lockstep.py       LockstepEngine (rank 0) and the followers' loop: the group in lockstep

Import from the modules (this package's __init__ imports nothing, so no module of it imports
another through it).
"""
