"""`batchrun serve`: the OpenAI Files and Batches API over batchrun's job machinery.

app.py (aiohttp routes) -> store.py (SQLite, WAL: files, batches, the queue)
                        -> executor.py (one batch at a time, FIFO; local engine or Slurm)
a batch = a batchrun run directory (runs/<batch id>/): resume, shards and merge are the job's
"""
