"""The byte-level BPE tokenizer, and the corpus as a flat array of token ids.

Byte-level BPE (GPT-2's pre-tokenisation) can encode any text without an unknown token, which matters for a corpus
of source code. The tokenizer prepends ``<s>`` (BOS) to every encoded text, because kvlab's prompts and the model's
training sequences all start with it: a fixed first token is where the model parks attention it does not need (the
attention sink that StreamingLLM keeps). ``</s>`` separates documents in the token stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` entries (the three special tokens included) on ``texts``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    bos = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, directory: Path, max_length: int) -> None:
    """Save as Hugging Face tokenizer files, loadable offline with ``AutoTokenizer.from_pretrained``."""
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, model_max_length=max_length
    )
    wrapped.save_pretrained(directory)


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str], batch: int = 2048) -> np.ndarray:
    """All ``texts`` as one ``uint16`` stream, each followed by ``</s>`` (no BOS: sequences get it when cut)."""
    eos = tokenizer.token_to_id(EOS)
    if tokenizer.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError("the token stream is stored as uint16; the vocabulary is too large for it")
    parts: list[np.ndarray] = []
    for start in range(0, len(texts), batch):
        for encoding in tokenizer.encode_batch(list(texts[start : start + batch]), add_special_tokens=False):
            parts.append(np.asarray(encoding.ids + [eos], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
