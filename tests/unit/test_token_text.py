"""Token texts for logprobs records: one batched decode per record for the ids not seen yet."""

from __future__ import annotations

from batchrun.io.records import Completion, logprob_token_ids
from batchrun.job.token_text import TokenTexts
from batchrun.params import TopLogprobs


class CountingTokenizer:
    def __init__(self):
        self.calls: list[list[list[int]]] = []

    def batch_decode(self, sequences, skip_special_tokens, clean_up_tokenization_spaces):
        assert not skip_special_tokens and not clean_up_tokenization_spaces
        self.calls.append(sequences)
        return [f"<{s[0]}>" for s in sequences]


def test_each_id_is_decoded_once_in_batches():
    tok = CountingTokenizer()
    texts = TokenTexts(tok)
    text = texts.prepare([5, 6, 5, 7])
    assert len(tok.calls) == 1 and sorted(s[0] for s in tok.calls[0]) == [5, 6, 7]
    assert [text(t) for t in (5, 6, 7)] == ["<5>", "<6>", "<7>"]
    text = texts.prepare([6, 7])  # all known: no call
    assert len(tok.calls) == 1
    text = texts.prepare([6, 9])  # only the new one
    assert tok.calls[1] == [[9]] and text(9) == "<9>"
    assert len(texts) == 4


def test_logprob_token_ids_names_chosen_and_top_tokens():
    top = [TopLogprobs([5, 9], [-0.1, -2.5]), TopLogprobs([6, 1], [-0.2, -3.0])]
    with_lp = Completion(0, "a", [5, 6], "stop", 3, 2, 0, [-0.1, -0.2], top)
    without = Completion(1, "b", [8], "stop", 3, 1, 0)
    assert logprob_token_ids([with_lp, without]) == [5, 6, 5, 9, 6, 1]
