"""Prefill-only tasks: embed, rerank, score and classify (issue 59).

layout.py    the sentence-transformers folder (modules.json, pooling, Normalize, prompts,
             max_seq_length) and config.json's head -> a frozen PoolingSpec
varlen.py    attention over packed variable-length sequences, causal or bidirectional, no KV
encoder.py   BERT / XLM-RoBERTa encoders and their classification heads
decoder.py   decoders (the registry's blocks) as embedders, classifiers and yes/no rerankers
heads.py     pooling (mean / CLS / last), normalization, Matryoshka truncation, scores
model.py     load_pooling_model: a model directory -> a PoolingModel that runs token lists
"""
