"""Prefill-only tasks: embed, rerank, score and classify (issue 59).

layout.py    the sentence-transformers folder (modules.json, pooling, Normalize, prompts,
             max_seq_length) and config.json's head -> a frozen PoolingSpec
varlen.py    the decoders' attention backend over packed sequences, no KV
shared_prefix.py  a causal step's shared prefixes computed once (a rerank row's query)
decoder.py   decoders (the registry's blocks) as embedders, classifiers and yes/no rerankers
heads.py     pooling (mean / CLS / last), normalization, Matryoshka truncation, scores
model.py     load_pooling_model: a model directory -> a PoolingModel that runs token lists
             (encoders: the registry's ENCODERS specs, models/bert.py, xlm_roberta.py, ...)
job_options.py   --task and its options (PoolingJobOptions), the default task of a model folder
job_rows.py      the job's input rows -> token rows or row errors, in tokenizer worker processes
row_tokens.py    one row -> its token rows; openai_rows.py, openai_embeddings.py,
                 openai_scores.py: OpenAI Batch rows (embeddings; vLLM's score and rerank)
job_engine.py    the engine interface the job's runner drives, over a PoolingEngine
job_sink.py      finished rows -> vector files, results / errors JSONL
vector_shard.py  Parquet vector files; vector_export.py: an embed run's export in input order
"""
