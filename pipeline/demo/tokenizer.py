"""A byte-level BPE tokenizer for the demo model, trained with `tokenizers`.

Special tokens: <pad>=0, <s>=1 (bos, prepended to every encoded text), </s>=2 (eos). Saved as a
transformers PreTrainedTokenizerFast, so `AutoTokenizer.from_pretrained(model_dir)` loads it.
"""
from __future__ import annotations

from typing import Iterable

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE over `texts`; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=sorted(pre_tokenizers.ByteLevel.alphabet()),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", BOS_ID)])
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [PAD_ID, BOS_ID, EOS_ID]
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", add_bos_token=True, model_max_length=1024)


def encode_plain(tokenizer, text: str) -> list[int]:
    """Token ids of `text` without the bos the tokenizer adds."""
    return tokenizer(text, add_special_tokens=False)["input_ids"]
