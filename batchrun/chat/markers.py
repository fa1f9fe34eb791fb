"""The tokens that open and close a model's thinking block, and the text that ends it early.

Three families, told apart by the tokenizer's vocabulary:

- ``think``: ``<think> ... </think>`` (Qwen3, Qwen3.5, DeepSeek-R1 distills, Phi-4-reasoning).
  Some templates open the block in the prompt (``<think>\\n`` after the assistant header), so the
  output only closes it. Ending it early writes ``\\n</think>\\n\\n``, the text Qwen's model card
  gives for a thinking budget, and the answer follows.
- ``harmony`` (gpt-oss): the reasoning is the ``analysis`` channel,
  ``<|channel|>analysis<|message|> ... <|end|>``; ending it early writes ``<|end|>`` and the
  header of the final answer, ``<|start|>assistant<|channel|>final<|message|>``.
- ``gemma4`` (Gemma 4, Google's prompt-formatting page): ``<|think|>`` in the system turn turns
  thinking on; the model's turn then starts ``<|channel>thought\\n ... <channel|>`` and the answer
  follows. Ending it early writes ``<channel|>``. A prompt that ends with a closed block (an empty
  ``<|channel>thought\\n<channel|>`` after the model header) answers first, as the think family's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchrun.chat.vocab import encode, token_ids

THINK, HARMONY, GEMMA4 = "think", "harmony", "gemma4"
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")
GEMMA4_TOKENS = ("<|channel>", "<channel|>", "<|turn>")
# how far back from a prompt's end an opening of the thinking block counts as open
PROMPT_TAIL = 16


@dataclass(frozen=True)
class ThinkMarkers:
    family: str  # THINK | HARMONY | GEMMA4
    start_ids: tuple[int, ...]  # the tokens that open a thinking block
    end_id: int  # the token that closes it
    forced_ids: tuple[int, ...]  # what ends it early; the answer follows
    # the tokens after which the answer starts: the end token, or harmony's final header
    answer_ids: tuple[int, ...]

    def answers_first(self, prompt_ids: list[int]) -> bool:
        """Whether the output starts with the answer: a think-family or gemma4 prompt that ends
        a thinking block near its end (a template that turns thinking off writes an empty one),
        or a harmony prompt that does not open an assistant message (no chat template wrote
        ``<|start|>assistant``: a text completion)."""
        tail = prompt_ids[-PROMPT_TAIL:]
        if self.family != HARMONY:
            return self.end_id in tail
        start = self.forced_ids[1]  # harmony's <|start|>
        return start not in tail or self.end_id in tail[len(tail) - tail[::-1].index(start) :]

    def opens_in(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt leaves a thinking block open (the template opened it): the
        start tokens close to its end, with no end token after them."""
        tail = prompt_ids[-PROMPT_TAIL:]
        n = len(self.start_ids)
        for i in range(len(tail) - 1, -1, -1):
            if tail[i] == self.end_id:
                return False
            if i + 1 >= n and tuple(tail[i + 1 - n : i + 1]) == self.start_ids:
                return True
        return False


def think_markers(tokenizer: Any, family: str | None = None) -> ThinkMarkers | None:
    """The markers of `family` (None: whichever the vocabulary has; harmony, then gemma4,
    then think), or None when the tokenizer lacks its tokens."""
    if family in (None, HARMONY):
        ids = token_ids(tokenizer, *HARMONY_TOKENS)
        if ids is not None:
            start, channel, message, end = ids
            final = (channel, *encode(tokenizer, "final"), message)
            return ThinkMarkers(
                HARMONY,
                (channel, *encode(tokenizer, "analysis"), message),
                end,
                (end, start, *encode(tokenizer, "assistant"), *final),
                final,
            )
    if family in (None, GEMMA4):
        ids = token_ids(tokenizer, *GEMMA4_TOKENS)
        if ids is not None:
            start, end, _turn = ids
            return ThinkMarkers(GEMMA4, (start, *encode(tokenizer, "thought")), end, (end,), (end,))
    if family in (None, THINK):
        ids = token_ids(tokenizer, "<think>", "</think>")
        if ids is not None:
            start, end = ids
            forced = (*encode(tokenizer, "\n"), end, *encode(tokenizer, "\n\n"))
            return ThinkMarkers(THINK, (start,), end, forced, (end,))
    return None
