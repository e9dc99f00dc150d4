"""Special tokens, placeholder expansion, label masking and the image-generation layout."""

import random

import numpy as np
import pytest

from tests.data.helpers import SMALL_PROCESSING, tokenizer_dir, write_png, write_wav
from torchtitan_omni.data import special_tokens as st
from torchtitan_omni.data.bad_samples import BadSample, Source
from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import DocumentEncoder
from torchtitan_omni.data.processors import build_processors
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.template import generation_prompt
from torchtitan_omni.data.tokenizer import OmniTokenizer, resolve_special_tokens
from torchtitan_omni.protocols import batch as B

SRC = Source("rows.jsonl", 7)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return OmniTokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok")))


def _encoder(tok, root, **kw):
    kw.setdefault("seq_len", 512)
    return DocumentEncoder(tok, build_processors(SMALL_PROCESSING), root=str(root), **kw)


def test_bundled_tokenizer_has_every_special_token(tok):
    vocab = tok.tokenizer.get_vocab(with_added_tokens=True)
    for name in st.ORDER:
        assert name in vocab
    assert tok.special.mapping == {n: n for n in st.ORDER}
    ids = [tok.special.bos, tok.special.eos, tok.special.pad, tok.special.end_of_turn,
           *tok.special.roles.values(), *(i for m in tok.special.media.values() for i in m)]
    assert len(set(ids)) == len(st.ORDER)
    assert tok.encode_text("hello") and tok.special.bos not in tok.encode_text("hello")


def test_llama3_style_vocabulary_maps_onto_reserved_tokens(tmp_path):
    vocab = {"hello": 0, "<|begin_of_text|>": 100, "<|end_of_text|>": 101, "<|eot_id|>": 109,
             "<|finetune_right_pad_id|>": 104, "<|start_header_id|>": 106}
    reserved = [2, 3, 5, 7, 8] + list(range(110, 140))
    for k, i in enumerate(reserved):
        vocab[f"<|reserved_special_token_{k}|>"] = 100 + i
    sp = resolve_special_tokens(vocab)
    assert (sp.bos, sp.eos, sp.end_of_turn, sp.pad) == (100, 101, 109, 104)
    assert sp.mapping[st.SYSTEM] == "<|reserved_special_token_0|>"
    assert sp.mapping[st.media_start("image")] == "<|reserved_special_token_3|>"
    used = [sp.mapping[n] for n in st.ORDER]
    assert len(set(used)) == len(used) and all(u in vocab for u in used)
    assert max(sp.roles.values()) < 200  # no vocabulary growth
    with pytest.raises(ValueError, match="lacks the omni special tokens"):
        resolve_special_tokens({"a": 0, "<|begin_of_text|>": 1})


def test_placeholder_expansion_counts_and_brackets(tok, tmp_path):
    img = write_png(tmp_path / "i.png", 20, 12)
    write_wav(tmp_path / "a.wav", 1.4, rate=16000)
    row = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image> and <audio> then <image>?"},
        {"role": "assistant", "content": "Two pictures."}],
        "images": ["i.png", img], "audio": "a.wav"}
    enc = _encoder(tok, tmp_path)
    doc, = enc.encode(parse_row(row, SRC), random.Random(0))
    procs = enc.processors
    for modality, refs in (("image", row["images"]), ("audio", [row["audio"]])):
        items = [it for r in refs for it in procs[modality](r, str(tmp_path))]
        start, pad, end = tok.special.media_ids(modality)
        n_expected = sum(it.num_tokens for it in items)
        assert (doc.tokens == pad).sum() == n_expected == len(doc.pad_positions[modality])
        assert (doc.tokens == start).sum() == len(refs) == (doc.tokens == end).sum()
        for s in np.flatnonzero(doc.tokens == start):
            run = doc.tokens[s + 1:]
            n = int(np.argmax(run != pad))
            assert doc.tokens[s + 1 + n] == end and n > 0
        assert len(doc.media[modality]) == len(items)
    assert len(doc.media["audio"]) == 2  # 1.4 s with 1 s chunks


def test_label_masking_prompts_placeholders_and_roles(tok, tmp_path):
    write_png(tmp_path / "i.png", 16, 16)
    row = {"conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "A cat."},
        {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}], "image": "i.png"}
    doc, = _encoder(tok, tmp_path).encode(parse_row(row, SRC), random.Random(0))
    labels = doc.labels()
    sp = tok.special
    answers = [tok.encode_text("A cat."), tok.encode_text("Yes.")]
    trained = [int(t) for t in labels if t != -100]
    assert trained == answers[0] + [sp.end_of_turn] + answers[1] + [sp.end_of_turn, sp.eos]
    start, pad, end = sp.media_ids("image")
    at_media = np.isin(doc.tokens, [start, pad, end])
    assert (labels[at_media] == -100).all()
    assert labels[-1] == -100  # document end

    (unmasked,) = _encoder(tok, tmp_path, mask_prompt_labels=False).encode(
        parse_row(row, SRC), random.Random(0)
    )
    lab = unmasked.labels()
    assert set(tok.encode_text("Sure?")) <= set(int(t) for t in lab if t != -100)
    assert (lab[np.isin(unmasked.tokens, [pad])] == -100).all()
    assert not np.isin(lab, [pad, end, sp.role("user"), sp.role("assistant")]).any()


def test_plain_text_all_targets_and_long_text_split(tok, tmp_path):
    enc = _encoder(tok, tmp_path, seq_len=16)
    docs = enc.encode(parse_row({"text": "hello world " * 20}, SRC), random.Random(0))
    assert len(docs) > 1 and all(len(d) <= 16 for d in docs)
    whole = np.concatenate([d.tokens for d in docs])
    assert whole[0] == tok.special.bos and whole[-1] == tok.special.eos
    assert (docs[0].labels()[:-1] == docs[0].tokens[1:]).all()
    enc.split_long_text = False
    with pytest.raises(BadSample, match="too_long"):
        enc.encode(parse_row({"text": "hello world " * 20}, SRC), random.Random(0))


def test_generation_layout_and_batch_indices(tok, tmp_path):
    cfg = SMALL_PROCESSING["gen_image"]
    n = cfg.num_tokens()
    rows = [{"messages": [{"role": "user", "content": f"draw {k}"},
                          {"role": "assistant", "content": "<gen_image>"}],
             "gen_images": [write_png(tmp_path / f"g{k}.png", 16, 16, seed=k)]} for k in range(3)]
    enc = _encoder(tok, tmp_path)
    docs = [enc.encode(parse_row(r, SRC), random.Random(0))[0] for r in rows]
    sp = tok.special
    start, pad, end = sp.media_ids("gen_image")
    # the prompt is exactly what generation code builds
    first = docs[0]
    s = int(first.gen_starts[0])
    assert first.tokens[:s + 1].tolist() == generation_prompt(tok, "draw 0")
    lab = first.labels()
    assert lab[s - 1] == start  # the text head learns to open an image
    assert (lab[s:s + n + 1] == -100).all()  # at <gen_image_start> and every pad
    assert lab[s + n + 1] == sp.end_of_turn

    batch, labels = collate([[docs[0], docs[1]], [docs[2]]], 128, sp.pad, enc.processors)
    emb = batch[B.embed_index_key("gen_image")]
    tgt = batch[B.target_index_key("gen_image")]
    flat_tokens, flat_emb, flat_tgt = batch[B.INPUT].flatten(), emb.flatten(), tgt.flatten()
    starts = (flat_tokens == start).nonzero().flatten().tolist()
    assert len(starts) == 3 and batch["gen_image_pixels"].shape == (3, 3, 16, 16)
    for i, p in enumerate(starts):  # items in flattened order
        assert flat_emb[p + 1:p + 1 + n].tolist() == [i * n + j for j in range(n)]
        assert flat_tgt[p] == i * n
        assert flat_tgt[p + 1:p + n].tolist() == [i * n + j + 1 for j in range(n - 1)]
        assert flat_tgt[p + n] == -1 and flat_emb[p] == -1
    assert (tgt >= 0).sum() == 3 * n
    torch_pixels = batch["gen_image_pixels"]
    for i, r in enumerate(rows):  # pixels in the same order
        ref = enc.processors["gen_image"](r["gen_images"][0], str(tmp_path))[0].tensors["pixels"]
        assert (torch_pixels[i] == ref).all()


def test_cfg_drop_replaces_caption_with_pad(tok, tmp_path):
    row = {"caption": "a red seven", "gen_image": write_png(tmp_path / "g.png", 16, 16)}
    (kept,) = _encoder(tok, tmp_path, gen_cfg_drop_prob=0.0).encode(
        parse_row(row, SRC), random.Random(0)
    )
    (dropped,) = _encoder(tok, tmp_path, gen_cfg_drop_prob=1.0).encode(
        parse_row(row, SRC), random.Random(0)
    )
    s = int(kept.gen_starts[0])
    assert dropped.tokens[0] == tok.special.bos
    assert (dropped.tokens[1:s] == tok.special.pad).all()
    assert (dropped.tokens[s:] == kept.tokens[s:]).all()
    assert dropped.tokens[: s + 1].tolist() == generation_prompt(
        tok, "a red seven", unconditional=True
    )
    rate = np.mean(
        [
            (
                _encoder(tok, tmp_path, gen_cfg_drop_prob=0.3)
                .encode(parse_row(row, SRC), random.Random(k))[0]
                .tokens[1]
                == tok.special.pad
            )
            for k in range(400)
        ]
    )
    assert 0.22 < rate < 0.38


def test_content_parts_and_inline_bytes(tok, tmp_path):
    png = write_png(tmp_path / "p.png", 16, 16)
    data = open(png, "rb").read()
    row = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look "}, {"type": "image", "image": data}]},
        {"role": "assistant", "content": "ok"}]}
    sample = parse_row(row, SRC)
    assert sample.turns[0].text == "look <image>" and sample.media["image"] == [data]
    doc, = _encoder(tok, tmp_path).encode(sample, random.Random(0))
    assert len(doc.media["image"]) == 1
