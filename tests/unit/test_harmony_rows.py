"""gpt-oss's `messages` rows: what its harmony chat template reads reaches it through
tokenize_rows. A template of the same shape as gpt-oss's (written here: the released one is not
downloaded) reads a leading developer (or system) message as the instructions, each assistant
turn's `thinking` (the analysis channel), and the date from transformers' strftime_now."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import save_byte_tokenizer  # noqa: E402

from batchrun.io.readers import RawRow  # noqa: E402
from batchrun.io.rows import PreparedRow, RowSpec, prepare_row  # noqa: E402
from batchrun.job.tokenize import TokenizedRow, tokenize_rows  # noqa: E402
from batchrun.params import SamplingParams  # noqa: E402

HARMONY_SHAPED = (
    "<|im_start|>system\nReasoning: {{ reasoning_effort | default('medium') }}\n"
    "Current date: {{ strftime_now('%Y-%m-%d') }}<|im_end|>"
    "{% set rest = messages %}"
    "{% if messages[0].role in ('developer', 'system') %}"
    "<|im_start|>developer\n{{ messages[0].content }}<|im_end|>{% set rest = messages[1:] %}"
    "{% endif %}"
    "{% for m in rest %}<|im_start|>{{ m.role }}\n"
    "{% if m.thinking is defined %}[analysis]{{ m.thinking }}[final]{% endif %}"
    "{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_byte_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = HARMONY_SHAPED
    return tok


def test_developer_and_thinking_reach_the_template(tokenizer):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "thinking": "add them"},
        {"role": "user", "content": "and 3+3?"},
    ]
    row = prepare_row(
        RawRow(0, {"messages": messages}, None), RowSpec(), SamplingParams(max_new_tokens=4), False
    )
    assert isinstance(row, PreparedRow)
    (out,) = tokenize_rows(tokenizer, [row], RowSpec(), context_len=4096)
    assert isinstance(out, TokenizedRow)
    text = tokenizer.decode(out.input_ids)
    assert "developer\nbe brief" in text and "Reasoning: medium" in text
    assert "Current date: 20" in text
    assert "assistant\n[analysis]add them[final]4" in text
    assert text.endswith("<|im_start|>assistant\n")
