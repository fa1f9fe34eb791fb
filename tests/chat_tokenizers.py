"""Tokenizers of the thinking / tool-calling families, written here (nothing is downloaded): a
byte-level vocabulary (ids 0..255 are bytes) plus each family's special tokens as its model card
and vendor docs give them, and a chat template of the same shape as the family's released one
for what the tests read (tools, tool calls and results, past reasoning, thinking on and off).

- qwen3: ChatML; ``<think>`` / ``</think>`` / ``<tool_call>`` / ``</tool_call>`` are added tokens
  that decode as text (not special), as in Qwen3's tokenizer; ``enable_thinking: false`` writes an
  empty ``<think>\\n\\n</think>\\n\\n`` block after the assistant header.
- deepseek_r1: a DeepSeek-R1 distill; its template opens ``<think>\\n`` in the prompt.
- gpt_oss: harmony's ``<|start|>``, ``<|channel|>``, ``<|message|>``, ``<|end|>``, ``<|call|>``,
  ``<|return|>``, ``<|constrain|>``; the template reads ``reasoning_effort``.
- llama3: Llama 3.1's header tokens, ``<|eot_id|>``, ``<|eom_id|>``, ``<|python_tag|>``.
- mistral: ``[INST]``, ``[/INST]``, ``[TOOL_CALLS]``, ``[AVAILABLE_TOOLS]``, ``[ARGS]``.
- gemma4: Google's Gemma 4 prompt-formatting page: turns ``<|turn>ROLE\\n ... <turn|>``,
  ``<|think|>`` in the system turn turns thinking on (``enable_thinking``), the model's thinking
  is ``<|channel>thought\\n ... <channel|>``; the tool tokens and the ``<|"|>`` string delimiter
  are special tokens too.
"""

from __future__ import annotations

from pathlib import Path

QWEN3_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content.strip('\\n') }}\n</think>\n\n"
    "{% endif %}{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% set tc = tc.function if tc.function else tc %}"
    '\n<tool_call>\n{"name": "{{ tc.name }}", "arguments": '
    "{% if tc.arguments is string %}{{ tc.arguments }}{% else %}{{ tc.arguments | tojson }}"
    "{% endif %}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)

R1_TEMPLATE = (
    "<｜begin▁of▁sentence｜>{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)

GPT_OSS_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n"
    "{% for t in tools %}\ntype {{ t.function.name }} = (_: any) => any;{% endfor %}\n"
    "} // namespace functions<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "{% if m.thinking and m.tool_calls %}"
    "<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "{% for tc in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions."
    "{{ tc.function.name }} <|constrain|>json<|message|>{{ tc.function.arguments | tojson }}"
    "<|call|>{% endfor %}"
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{% endif %}"
    "{% elif m.role == 'tool' %}<|start|>functions.{{ m.name or 'tool' }} to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}'
    "{% endfor %}<|eom_id|>{% else %}{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

MISTRAL_TEMPLATE = (
    "<s>{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content }}</s>{% endif %}{% endfor %}"
)

GEMMA4_TEMPLATE = (
    "<bos>{% set sys = messages[0].content if messages[0].role == 'system' else '' %}"
    "{% if enable_thinking or sys %}<|turn>system\n{% if enable_thinking %}<|think|>{% endif %}"
    "{{ sys }}<turn|>\n{% endif %}"
    "{% for m in messages %}{% if m.role != 'system' %}"
    "<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n{{ m.content }}<turn|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)

FAMILIES = {
    "qwen3": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=[
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ],  # fmt: skip
        eos="<|im_end|>",
        template=QWEN3_TEMPLATE,
    ),
    "deepseek_r1": dict(
        special=[
            "<｜begin▁of▁sentence｜>",
            "<｜end▁of▁sentence｜>",
            "<｜User｜>",
            "<｜Assistant｜>",
        ],
        added=["<think>", "</think>"],
        eos="<｜end▁of▁sentence｜>",
        template=R1_TEMPLATE,
    ),
    "gpt_oss": dict(
        special=[
            "<|endoftext|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|channel|>",
            "<|constrain|>",
            "<|return|>",
            "<|call|>",
        ],  # fmt: skip
        added=[],
        eos="<|return|>",
        template=GPT_OSS_TEMPLATE,
    ),
    "llama3": dict(
        special=[
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],  # fmt: skip
        added=[],
        eos="<|eot_id|>",
        template=LLAMA3_TEMPLATE,
    ),
    "mistral": dict(
        special=[
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[ARGS]",
        ],  # fmt: skip
        added=[],
        eos="</s>",
        template=MISTRAL_TEMPLATE,
    ),
    "gemma4": dict(
        special=[
            "<bos>",
            "<eos>",
            "<|turn>",
            "<turn|>",
            "<|think|>",
            "<|channel>",
            "<channel|>",
            "<|tool>",
            "<tool|>",
            "<|tool_call>",
            "<tool_call|>",
            "<|tool_response>",
            "<tool_response|>",
            '<|"|>',
        ],  # fmt: skip
        added=[],
        eos="<turn|>",
        template=GEMMA4_TEMPLATE,
    ),
}


def make_tokenizer(family: str, path: Path | None = None):
    """The family's tokenizer (saved to `path` when given, for a model directory)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: ord(c)))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(spec["special"])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec["eos"])
    fast.chat_template = spec["template"]
    if path is not None:
        fast.save_pretrained(path)
    return fast


def ids(tokenizer, text: str) -> list[int]:
    """A model output given as its token ids (special tokens by their text)."""
    return tokenizer.encode(text, add_special_tokens=False)
