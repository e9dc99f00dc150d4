"""Hand-built packed batches that mix every modality a model supports (no data pipeline).

Each encoder modality gets a small random item made from the encoder's own processing config;
the placeholder count is what the encoder returns for it. Generation targets get their
placeholders (``gen_image_embed_index``) and the positions that predict them
(``gen_image_target_index``: the position before each code).
"""

from __future__ import annotations

import torch

from torchtitan_omni.protocols import batch as B


def _media(encoder, modality: str, g: torch.Generator) -> dict[str, torch.Tensor]:
    """A random item of ``modality``, two patches' worth bigger than the encoder's dummy."""
    p = encoder.processing(modality)
    if modality in (B.IMAGE, B.VIDEO) and p.mode == "patches":
        from torchtitan_omni.encoders.vision import patchify

        side = p.factor * 2
        frames = 3 if modality == B.VIDEO else 1
        patches, grid = patchify(torch.randn(frames, 3, side, side, generator=g), p.patch_size,
                                 p.merge_size, p.temporal_patch_size)
        return {"patches": patches, "grid_thw": torch.tensor([grid])}
    if modality == B.IMAGE:
        return {"pixels": torch.randn(1, 3, p.image_size, p.image_size, generator=g)}
    if modality == B.AUDIO:
        frames = 37
        return {"features": torch.randn(1, p.n_mels, frames, generator=g),
                "lengths": torch.tensor([frames])}
    raise ValueError(f"no test media for {modality}")


def mixed_batch(model, vocab: int, seed: int = 0, multiple: int = 1
                ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(batch, labels)`` with two rows: row 0 text + every encoder modality, row 1 text +
    every decoder's targets (and a second document), padded to one length, a multiple of
    ``multiple`` (e.g. the Ulysses degree)."""
    g = torch.Generator().manual_seed(seed)
    batch: dict[str, torch.Tensor] = {}
    rows: list[list[tuple[str, object]]] = [[], []]  # (kind, payload) segments per row

    def text(n):
        return ("text", torch.randint(0, vocab, (n,), generator=g))

    rows[0].append(text(5))
    for modality, enc_name in model.encoder_of.items():
        media = _media(model.encoders[enc_name], modality, g)
        with torch.no_grad():
            n = model.encoders[enc_name](media, modality).shape[0]
        for key, value in media.items():
            batch[f"{modality}_{key}"] = value
        rows[0] += [("embed", (modality, n)), text(3)]
    rows[1].append(text(4))
    for name, dec in model.decoders.items():
        size = dec.processing().image_size
        pixels = torch.rand(1, 3, size, size, generator=g) * 2 - 1
        batch[f"{name}_pixels"] = pixels
        n = dec.encode_targets({"pixels": pixels}).numel()
        rows[1] += [("gen", (name, n)), text(2)]

    length = max(sum(_len(s) for s in r) for r in rows) + 3
    length = -(-length // multiple) * multiple
    tokens = torch.zeros(2, length, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, B.IGNORE_INDEX)
    index = {}
    bounds, real = [0], 0
    for r, segments in enumerate(rows):
        pos, counters = 0, {}
        for kind, payload in segments:
            if kind == "text":
                n = len(payload)
                tokens[r, pos:pos + n] = payload
                labels[r, pos:pos + n - 1] = payload[1:]
            else:
                key_name, n = payload
                key = B.embed_index_key(key_name)
                index.setdefault(key, torch.full_like(tokens, -1))
                start = counters.get(key_name, 0)
                index[key][r, pos:pos + n] = torch.arange(start, start + n)
                counters[key_name] = start + n
                if kind == "gen":
                    tkey = B.target_index_key(key_name)
                    index.setdefault(tkey, torch.full_like(tokens, -1))
                    index[tkey][r, pos - 1:pos + n - 1] = torch.arange(start, start + n)
            pos += n
        positions[r, :pos] = torch.arange(pos)
        bounds.append(r * length + pos)
        real += pos
        if pos < length:  # padding is a document of its own
            positions[r, pos:] = torch.arange(length - pos)
            bounds.append((r + 1) * length)
    batch.update(index)
    batch[B.INPUT] = tokens
    batch[B.POSITION_IDS] = positions
    batch[B.CU_SEQLENS] = torch.tensor(bounds, dtype=torch.int32)
    batch[B.REAL_TOKENS] = torch.tensor(real)
    return batch, labels


def _len(segment) -> int:
    kind, payload = segment
    return len(payload) if kind == "text" else payload[1]
