"""Test helpers: tiny Hugging Face checkpoint folders as a user would bring them.

``make_folder(arch, out, tokenizer)`` builds a random ``transformers`` model from a small
config with odd sizes (GQA 3:1, head_dim 20 on width 60, an FFN width that is no multiple of
either, 6 experts top-2 for the MoE), saves it with ``save_pretrained`` (offline) next to a
tokenizer, and returns the model. ``tokenizer="bundled"``: the test tokenizer, which has every
omni special token; ``"plain"``: a small byte-level BPE without them (they are added, and the
vocabulary grows).
"""

from __future__ import annotations

import os
import shutil

import torch

from tests.harness import REPO

TEST_TOKENIZER = REPO / "tests" / "assets" / "tokenizer"

#: arch -> (omni spec, transformers config class, model class, config keys)
ARCHS = {
    "llama": ("llama_omni", "LlamaConfig", "LlamaForCausalLM", dict(
        intermediate_size=100, tie_word_embeddings=True, rope_theta=10000.0,
        # original_max_position_embeddings 32 puts head_dim 20's frequencies in all three
        # regions of the Llama-3.1 rule (kept, smoothed, divided)
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": ("qwen3_omni", "Qwen3Config", "Qwen3ForCausalLM", dict(
        intermediate_size=100, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe_omni", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_experts=6, num_experts_per_tok=2, moe_intermediate_size=36, norm_topk_prob=True,
        tie_word_embeddings=False)),
}

SHAPE = dict(hidden_size=60, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
             head_dim=20, max_position_embeddings=512, initializer_range=0.15)


def plain_tokenizer(out) -> int:
    """A byte-level BPE with no special tokens at all (like Llama-2's: nothing reserved);
    returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = "The quick brown fox jumps over the lazy dog, then reads the Python documentation."
    tok.train_from_iterator([text] * 8, trainer=trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    return tok.get_vocab_size()


def make_folder(arch: str, out, tokenizer: str = "bundled", seed: int = 0):
    """Save a random ``arch`` model and a tokenizer into ``out``; returns the model (eval)."""
    import transformers

    os.makedirs(out, exist_ok=True)
    if tokenizer == "plain":
        vocab = plain_tokenizer(out)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TEST_TOKENIZER / name, os.path.join(out, name))
        vocab = 4096
    _, config_cls, model_cls, keys = ARCHS[arch]
    config = getattr(transformers, config_cls)(vocab_size=vocab, **SHAPE, **keys)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # HF initializes norms to one; random norms test their mapping
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return model
