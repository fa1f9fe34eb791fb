"""Tiny random embedding, reranking and classification models saved in their real layouts (the
sentence-transformers folder included), for parity tests against sentence-transformers and
transformers. Byte-level tokenizers with each family's special tokens, no chat template."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 260  # bytes + 4 specials
ENCODER = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    intermediate_size=128, max_position_embeddings=130, initializer_range=0.2,
)  # fmt: skip
DECODER = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    initializer_range=0.15, tie_word_embeddings=False, pad_token_id=259,
)  # fmt: skip
TEXTS = [
    "hello world",
    "a",
    "the quick brown fox jumps over the lazy dog " * 4,
    "zz",
    "embeddings of mixed lengths",
    "x" * 70,
    "short",
    "What is the capital of France? Paris.",
    "b c d e f g",
    "lorem ipsum dolor sit amet, consectetur adipiscing elit " * 2,
    "é ü ö — unicode",
    "1 2 3",
    "another text of middling length here",
    "q",
    "batch of sixteen",
    "the end",
]


def save_tokenizer(path: Path, family: str) -> None:
    """family "bert": [CLS] a [SEP] b [SEP] with token types; "roberta": <s> a </s></s> b </s>;
    "decoder": the text then <|im_end|> (an embedder's end token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(ByteLevel.alphabet(), key=ord)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = {"bert": ["[CLS]", "[SEP]", "[PAD]", "[UNK]"],
                "roberta": ["<s>", "</s>", "<pad>", "<unk>"],
                "decoder": ["<|im_start|>", "<|im_end|>", "<unk>", "<pad>"]}[family]  # fmt: skip
    tok.add_special_tokens(specials)
    ids = {s: 256 + i for i, s in enumerate(specials)}
    a, b = specials[:2]
    if family == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{a} $A {b}", pair=f"{a} $A {b} $B:1 {b}:1", special_tokens=list(ids.items())
        )
    elif family == "roberta":
        tok.post_processor = processors.TemplateProcessing(
            single=f"{a} $A {b}", pair=f"{a} $A {b} {b} $B {b}", special_tokens=list(ids.items())
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single=f"$A {b}", pair=f"$A $B {b}", special_tokens=[(b, ids[b])]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=specials[2] if family != "decoder" else "<pad>",
        unk_token=specials[3] if family != "decoder" else "<unk>",
    )  # fmt: skip
    if family == "decoder":
        fast.padding_side = "left"
    fast.save_pretrained(path)


def save_hf(path: Path, model, family: str, seed: int = 0):
    model.eval().save_pretrained(path)
    save_tokenizer(path, family)
    return model


def make_encoder(path: Path, kind: str, num_labels: int = 0, seed: int = 0):
    """kind bert / xlm-roberta / modernbert; num_labels 0: the base model, else its sequence
    classifier."""
    import transformers

    torch.manual_seed(seed)
    if kind == "modernbert":
        # local layers see |q - k| <= 4: the test texts are longer than the window
        cfg = transformers.ModernBertConfig(
            **ENCODER, pad_token_id=258, cls_token_id=256, sep_token_id=257, local_attention=8,
            global_attn_every_n_layers=2, classifier_pooling="mean", norm_bias=True,
        )  # fmt: skip
        base = transformers.ModernBertModel
        head = transformers.ModernBertForSequenceClassification
    elif kind == "bert":
        cfg = transformers.BertConfig(**ENCODER, pad_token_id=258)
        base, head = transformers.BertModel, transformers.BertForSequenceClassification
    else:
        # NOTE: positions start at pad_token_id + 1 (258 + 1)
        cfg = transformers.XLMRobertaConfig(
            **{**ENCODER, "max_position_embeddings": 259 + 130}, pad_token_id=258,
            bos_token_id=256, eos_token_id=257,
        )  # fmt: skip
        base, head = transformers.XLMRobertaModel, transformers.XLMRobertaForSequenceClassification
    if num_labels:
        cfg.num_labels = num_labels
        model = head(cfg)
    else:
        model = base(cfg) if kind == "modernbert" else base(cfg, add_pooling_layer=False)
    return save_hf(path, model, "roberta" if kind == "xlm-roberta" else "bert")


def make_decoder(path: Path, kind: str, head: str, num_labels: int = 1, seed: int = 0):
    """kind llama / qwen2 (gte-Qwen2) / qwen3 / mistral (e5-mistral) / gemma3 (text, sliding
    layers); head base (<Arch>Model), classify,
    lm (<Arch>ForCausalLM)."""
    import transformers

    torch.manual_seed(seed)
    extra = {"head_dim": 32} if kind in ("qwen3", "gemma3") else {}
    if kind == "gemma3":  # layers 0-1 slide over 6 positions, layer 2 sees all
        extra.update(sliding_window=6, layer_types=["sliding_attention"] * 2 + ["full_attention"],
                     num_hidden_layers=3, hidden_activation="gelu_pytorch_tanh")  # fmt: skip
    if kind == "mistral":  # e5-mistral: every layer over the whole context
        extra["sliding_window"] = None
    config_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
                  "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
                  "gemma3": transformers.Gemma3TextConfig}[kind]  # fmt: skip
    # NOTE: Qwen3-Reranker's prompt alone is ~200 byte tokens
    cfg = config_cls(**{**DECODER, "max_position_embeddings": 1024, **extra}, num_labels=num_labels)
    prefix = {"llama": "Llama", "qwen3": "Qwen3", "qwen2": "Qwen2", "mistral": "Mistral",
              "gemma3": "Gemma3Text"}[kind]  # fmt: skip
    suffix = {"base": "Model", "classify": "ForSequenceClassification", "lm": "ForCausalLM"}[head]
    model = getattr(transformers, prefix + suffix)(cfg)
    return save_hf(path, model, "decoder")


def make_sentence_transformer(
    src: Path, dest: Path, pooling: str, normalize: bool,
    max_seq_length: int, prompts: dict | None = None,
) -> None:  # fmt: skip
    """A sentence-transformers folder at `dest` of the HF model at `src`."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    word = modules.Transformer(str(src), max_seq_length=max_seq_length)
    mods = [word, modules.Pooling(word.get_embedding_dimension(), pooling)]
    if normalize:
        mods.append(modules.Normalize())
    SentenceTransformer(modules=mods, device="cpu", prompts=prompts).save(str(dest))
