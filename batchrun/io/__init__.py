"""Input and output of a batch job: stream rows from a dataset, turn them into prepared rows,
encode result / error records, and write them as atomic JSONL shards plus a manifest."""
