"""What a chat model's output holds besides its answer: reasoning kept apart from the text
(``reasoning.py``: the ``<think>`` family; ``harmony.py``: gpt-oss's channels) and tool calls
parsed into structured data (``tool_calls.py``), chosen by name or detected from the tokenizer
(``parsers.py``). ``markers.py`` names the tokens that open and close a thinking block, which
the engine's thinking budget (batchrun/engine/thinking.py) also reads.

Everything here runs on the host, in the writer's path, on a finished completion's token ids.
"""
