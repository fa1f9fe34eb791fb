"""Prefill-only tasks: embed, rerank, score and classify (issue 59).

layout.py    the sentence-transformers folder (modules.json, pooling, Normalize, prompts,
             max_seq_length) and config.json's head -> a frozen PoolingSpec
varlen.py    attention over packed variable-length sequences, causal or bidirectional, no KV
encoder.py   BERT / XLM-RoBERTa encoders and their classification heads
decoder.py   decoders (the registry's blocks) as embedders, classifiers and yes/no rerankers
heads.py     pooling (mean / CLS / last), normalization, Matryoshka truncation, scores
model.py     load_pooling_model: a model directory -> a PoolingModel that runs token lists
job_options.py   --task and its options (PoolingJobOptions), the default task of a model folder
job_rows.py      the job's input rows -> token rows or row errors (OpenAI /v1/embeddings too)
job_engine.py    the engine interface the job's runner drives, over a PoolingEngine
job_sink.py      finished rows -> vector files, results / errors JSONL
vector_shard.py  Parquet vector files; vector_export.py: an embed run's export in input order
"""
