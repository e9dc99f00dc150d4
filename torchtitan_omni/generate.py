"""Sampling from a trained omni model: text from a prompt with media, images from a caption.

    python -m torchtitan_omni.generate --job.config_file train_configs/janus_debug.toml \\
        --generate.prompt "What digit is in <image>?" \\
        --generate.media data/omni_default/media/digits/test/00000.png
    python -m torchtitan_omni.generate --job.config_file train_configs/janus_debug.toml \\
        --generate.mode image --generate.prompt "a handwritten seven" --generate.num_images 4

The model is built from the job's config, its weights loaded from the newest complete DCP
checkpoint (``generate.checkpoint``, default ``<job.dump_folder>/<checkpoint.folder>``; a LoRA
job's adapters included, its base from ``weights.sources`` when the checkpoint is
adapter-only), and decoding runs one process on one device with a KV cache
(``torchtitan_omni.modules.attention.KVCache``).

Text mode lays the prompt out exactly as training did (the data pipeline's template and
processors), runs the encoders on its media, then samples until end-of-turn. Image mode
prompts with the caption up to ``<gen_image_start>`` and samples the image's codes from the
image decoder's head with classifier-free guidance: each step scores the conditional and the
unconditional prompt (caption replaced by pad tokens, as in training's caption drop) and
samples from ``uncond + cfg_scale * (cond - uncond)``; the codes feed back through the
decoder's ``lm_embed``, and ``lm_generate`` turns the finished codes into pixels (PNG).
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Sequence

import torchtitan_omni  # noqa: F401  (selects the device before TorchTitan loads)
import numpy as np
from PIL import Image
import torch

from torchtitan.config import JobConfig
from torchtitan.tools.logging import init_logger, logger

from torchtitan_omni.checkpoint.completion import DCP_METADATA, scan
from torchtitan_omni.checkpoint.weights import load_job_weights
from torchtitan_omni.config.manager import ConfigError, parse_job_config_or_exit
from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.collate import collate
from torchtitan_omni.data.document import Document, DocumentEncoder
from torchtitan_omni.data.processors import build_processors
from torchtitan_omni.data.sample import Sample, Turn, split_placeholders
from torchtitan_omni.data.template import generation_prompt
from torchtitan_omni.data.tokenizer import build_omni_tokenizer
from torchtitan_omni.distributed.process_group import init_process_group
from torchtitan_omni.errors import OmniInputError
from torchtitan_omni.job_model import job_model_args, model_on_meta
from torchtitan_omni.lora import apply_lora_config
from torchtitan_omni.modules.attention import KVCache
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.platform import local_device
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of ``logits`` ``[n, V]``: greedy at temperature 0, else sampled."""
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def checkpoint_to_load(cfg: JobConfig, checkpoint: str | None = None) -> str:
    """The checkpoint generation loads: ``checkpoint``, else ``generate.checkpoint``, else the
    job's checkpoint folder (``<job.dump_folder>/<checkpoint.folder>``). A place without any
    checkpoint is a :class:`ConfigError` that says where it looked and how to get one."""
    path = checkpoint or cfg.generate.checkpoint or os.path.join(
        cfg.job.dump_folder, cfg.checkpoint.folder)
    complete, skipped = scan(path)
    if complete or skipped or os.path.isfile(os.path.join(path, DCP_METADATA)):
        return path  # loading reports a damaged or incomplete one itself
    off = "" if cfg.checkpoint.enable else " (this config has checkpoint.enable = false)"
    raise ConfigError(
        f"generation needs a trained checkpoint and there is none in {path}: train the job "
        f"with [checkpoint] enable = true in its TOML or --checkpoint.enable{off}, or point "
        "--generate.checkpoint at a checkpoint folder")


class Generator:
    """An omni model with its tokenizer and processors, ready to decode with a KV cache."""

    def __init__(self, model: OmniModel, tokenizer, processors: dict, device: torch.device) -> None:
        self.model = model.eval()
        self.tok = tokenizer
        self.processors = processors
        self.device = device

    @classmethod
    def from_config(cls, cfg: JobConfig, checkpoint: str | None = None) -> "Generator":
        """Build the job's model on ``local_device()`` and load its newest checkpoint."""
        path = checkpoint_to_load(cfg, checkpoint)
        device = local_device()
        tokenizer = build_omni_tokenizer(cfg)
        processors = build_processors(dict(job_model_args(cfg).processing()))
        model = model_on_meta(cfg)
        if cfg.lora.enable:  # the adapters are part of the trained model
            apply_lora_config(model, cfg.lora)
        model.to_empty(device=device)
        model.init_seed = cfg.omni.init_seed
        with torch.no_grad():
            model.init_weights(buffer_device=device)
        load_job_weights(model, path, list(cfg.weights.sources))
        logger.info(f"Loaded {cfg.model.name} {cfg.model.flavor} from {path}")
        return cls(model, tokenizer, processors, device)

    # ----------------------------------------------------------------- decoding
    def _forward(self, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run the foundation on new embeddings ``[n, s, dim]`` after ``len(cache)`` positions."""
        start = len(cache)
        positions = torch.arange(start, start + h.shape[1], device=self.device).expand(
            h.shape[0], -1
        )
        return self.model.llm(h, AttentionMeta(None, 0, positions, kv_cache=cache))

    def prompt_batch(self, prompt: str, media: list[str]) -> dict[str, torch.Tensor]:
        """The prompt as a one-row batch (template, placeholders, media) ending in the
        assistant marker, laid out as the data pipeline lays out training samples."""
        wanted = [p[0] for p in split_placeholders(prompt) if isinstance(p, tuple)]
        if len(wanted) != len(media):
            raise ConfigError(
                f"generate.prompt has {len(wanted)} media placeholder(s) but generate.media "
                f"names {len(media)} file(s)")
        refs: dict[str, list[str]] = {}
        for modality, path in zip(wanted, media):
            refs.setdefault(modality, []).append(os.path.abspath(path))
        sample = Sample(Source("<prompt>", 0), turns=[Turn("user", prompt)], media=refs)
        return self.sample_batch(sample, os.getcwd())

    def sample_batch(self, sample: Sample, root: str) -> dict[str, torch.Tensor]:
        """A parsed sample whose turns end with a user turn (media relative to ``root``) as a
        one-row batch that opens the assistant turn, laid out as in training."""
        encoder = DocumentEncoder(self.tok, self.processors, seq_len=1 << 30, root=root)
        doc = encoder.encode(sample, random.Random(0))[0]
        # Drop the sample's closing eos and open the assistant turn instead.
        tokens = np.concatenate([doc.tokens[:-1], [self.tok.special.role("assistant")]])
        prompt_doc = Document(
            tokens, np.zeros(len(tokens), dtype=bool), doc.media, doc.pad_positions
        )
        batch, _ = collate([[prompt_doc]], len(tokens), self.tok.special.pad, self.processors)
        return {k: v.to(self.device) for k, v in batch.items()}

    @torch.no_grad()
    def text(
        self,
        prompt: str,
        media: Sequence[str] = (),
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> list[int]:
        """Token ids of the answer to ``prompt`` (stops at end-of-turn or end-of-text)."""
        return self.answer(self.prompt_batch(prompt, list(media)), max_new_tokens, temperature,
                           top_k, generator)

    @torch.no_grad()
    def answer(self, batch: dict[str, torch.Tensor], max_new_tokens: int = 64,
               temperature: float = 1.0, top_k: int = 0,
               generator: torch.Generator | None = None) -> list[int]:
        """Token ids that continue a prompt batch (:meth:`prompt_batch`, :meth:`sample_batch`)
        until end-of-turn or end-of-text."""
        h, _ = self.model.embed(batch[B.INPUT], batch)
        cache = KVCache()
        hidden = self._forward(h, cache)
        stops = {self.tok.special.end_of_turn, self.tok.special.eos}
        out: list[int] = []
        for _ in range(max_new_tokens):
            logits = self.model.llm.output(hidden[:, -1])
            nxt = sample_next(logits, temperature, top_k, generator)
            if int(nxt) in stops:
                break
            out.append(int(nxt))
            hidden = self._forward(self.model.llm.tok_embeddings(nxt[:, None]), cache)
        return out

    @torch.no_grad()
    def image_codes(self, caption: str, num_images: int = 1, cfg_scale: float = 5.0,
                    temperature: float = 1.0, top_k: int = 0,
                    generator: torch.Generator | None = None) -> torch.Tensor:
        """Image-decoder ids ``[num_images, tokens_per_image]`` for ``caption``."""
        if B.GEN_IMAGE not in self.model.decoders:
            raise ConfigError(
                f"generate.mode='image' needs an image decoder; {type(self.model).__name__} has "
                "none"
            )
        decoder = self.model.decoder(B.GEN_IMAGE)
        per_image = decoder.processing().num_tokens()
        cond = generation_prompt(self.tok, caption)
        uncond = generation_prompt(self.tok, caption, unconditional=True)
        guided = cfg_scale != 1.0
        rows = [cond] * num_images + ([uncond] * num_images if guided else [])
        ids = torch.tensor(rows, device=self.device)
        cache = KVCache()
        hidden = self._forward(self.model.llm.tok_embeddings(ids), cache)
        codes = []
        for _ in range(per_image):
            logits = decoder.logits(hidden[:, -1]).float()
            if guided:
                c, u = logits[:num_images], logits[num_images:]
                logits = u + cfg_scale * (c - u)
            nxt = sample_next(logits, temperature, top_k, generator)
            codes.append(nxt)
            step_ids = nxt.repeat(2) if guided else nxt
            hidden = self._forward(decoder.lm_embed(step_ids)[:, None], cache)
        return torch.stack(codes, dim=1)

    @torch.no_grad()
    def images(self, caption: str, **kwargs) -> torch.Tensor:
        """Images ``[n, 3, H, W]`` in ``[-1, 1]`` drawn for ``caption`` (see
        :meth:`image_codes`)."""
        codes = self.image_codes(caption, **kwargs)
        return self.model.decoder(B.GEN_IMAGE).lm_generate(codes)


def save_png(image: torch.Tensor, path: str) -> None:
    """Write an image ``[3, H, W]`` in ``[-1, 1]`` as PNG."""
    pixels = (
        ((image.float().clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).cpu().numpy()
    )
    Image.fromarray(pixels).save(path)


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m torchtitan_omni.generate``."""
    init_logger()
    cfg = parse_job_config_or_exit(argv)
    g = cfg.generate
    if not g.prompt:
        print("torchtitan-omni: config error: --generate.prompt is empty", file=sys.stderr)
        sys.exit(2)

    init_process_group()  # DCP reads through a (single-process) group
    try:
        _run(cfg)
    except (OmniInputError, FileNotFoundError) as e:
        print(f"torchtitan-omni: error: {e}", file=sys.stderr)
        sys.exit(1)


def _run(cfg: JobConfig) -> None:
    g = cfg.generate
    gen = Generator.from_config(cfg)
    rng = torch.Generator(device=gen.device).manual_seed(g.seed)
    os.makedirs(g.output, exist_ok=True)
    if g.mode == "text":
        ids = gen.text(g.prompt, g.media, g.max_new_tokens, g.temperature, g.top_k, rng)
        answer = gen.tok.decode(ids)
        with open(os.path.join(g.output, "answer.txt"), "w") as f:
            f.write(answer + "\n")
        print(answer)
    else:
        images = gen.images(g.prompt, num_images=g.num_images, cfg_scale=g.cfg_scale,
                            temperature=g.temperature, top_k=g.top_k, generator=rng)
        for i, image in enumerate(images):
            path = os.path.join(g.output, f"image_{i}.png")
            save_png(image, path)
            print(path)

if __name__ == "__main__":
    main()
