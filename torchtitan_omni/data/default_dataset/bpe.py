"""The bundled tokenizer: a byte-level BPE trained on the dataset's text with ``tokenizers``,
the omni special tokens first (ids 0..len(ORDER)-1)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtitan_omni.data import special_tokens as st


def train_tokenizer(texts: list[str], out_dir: str, vocab_size: int = 4096) -> None:
    """Train on ``texts`` and save ``tokenizer.json`` and ``tokenizer_config.json``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(st.ORDER),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "bos_token": st.BOS, "eos_token": st.EOS, "pad_token": st.PAD,
        "add_bos_token": False, "add_eos_token": False,
        "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast",
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
