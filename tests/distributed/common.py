"""Tiny omni models, packed batches with media, and the single-process reference for the
parallelism parity tests.

The models are real framework parts (Llama-3 or Qwen3-MoE foundation, ``OmniModel``) plus two
small encoders written here against the ``OmniEncoder`` contract (an image encoder over
patches with per-item attention, and an audio encoder over mel frames), so that the tests do
not depend on the size of the zoo's encoders; ``ModelSpec(zoo="llama_omni")`` is instead a
registered spec's debug model (batches: ``tests.models.batches.mixed_batch``).

``parallel_step`` runs one training step's forward and backward the way ``OmniTrainer`` does
(slice the SP share, global target counts over the ``loss`` mesh, ``OmniLoss``, backward);
``reference_step`` runs the same global batch in one process on an unsharded copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan_omni.components.loss import OmniLoss
from torchtitan_omni.distributed.parallel_dims import OmniParallelDims
from torchtitan_omni.distributed.parallelize import parallelize_omni
from torchtitan_omni.distributed.sequence import shard_sequence
from torchtitan_omni.distributed.utils import all_reduce
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.foundations.qwen3_moe import Qwen3Moe, Qwen3MoeArgs
from torchtitan_omni.modules import init
from torchtitan_omni.modules.attention import SelfAttention
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modules import AttentionMeta, OmniEncoder
from torchtitan_omni.protocols.plan import OmniParallelPlan, PartLayout
from torchtitan_omni.protocols.processing import AudioProcessing, ImageProcessing

VOCAB, DIM, PATCH, MELS = 64, 32, 12, 8
IMAGE_TOKEN, AUDIO_TOKEN = 1, 2


# ----------------------------------------------------------------- config
def job_config(**overrides):
    """A merged (TorchTitan + omni) ``JobConfig`` with AC off; ``section__key=value`` overrides."""
    from torchtitan_omni.config.merge import default_job_config

    cfg = default_job_config()
    cfg.activation_checkpoint.mode = "none"
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


# ----------------------------------------------------------------- tiny encoders
class TinyImageEncoder(OmniEncoder):
    """Patches ``[N, PATCH]`` + ``grid_thw`` -> one LLM row per patch, attention per image."""

    modalities = ("image",)

    def __init__(self, llm_dim: int, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(PATCH, width)
        self.attn = SelfAttention(width, heads, causal=False)
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, llm_dim)

    def lm_encode(self, media, modality):
        grid = media["grid_thw"]
        lengths = grid.prod(-1)
        x = self.embed(media["patches"]).unsqueeze(0)
        cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
        meta = AttentionMeta(
            cu, int(lengths.max()), torch.zeros_like(x[..., 0], dtype=torch.long), causal=False
        )
        x = x + self.attn(self.norm(x), meta)
        return self.proj(x[0])

    def processing(self, modality):
        return ImageProcessing()

    def output_rows(self, media, modality):
        return int(media["grid_thw"].prod(-1).sum())

    def dummy_media(self, modality, device):
        return {"patches": torch.zeros(1, PATCH, device=device),
                "grid_thw": torch.ones(1, 3, dtype=torch.long, device=device)}

    def init_weights(self, buffer_device=None):
        for lin in (self.embed, self.proj):
            init.trunc_normal_(lin.weight, std=0.2)
            init.zeros_(lin.bias)
        self.attn.init_weights(0.2)
        init.ones_(self.norm.weight)
        init.zeros_(self.norm.bias)


class TinyAudioEncoder(OmniEncoder):
    """Features ``[n, MELS, T]`` + ``lengths`` -> ``ceil(len / 2)`` rows per clip."""

    modalities = ("audio",)

    def __init__(self, llm_dim: int, width: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv1d(MELS, width, kernel_size=2, stride=2)
        self.proj = nn.Linear(width, llm_dim)

    def lm_encode(self, media, modality):
        feats, lengths = media["features"], media["lengths"]
        if feats.shape[-1] % 2:
            feats = nn.functional.pad(feats, (0, 1))
        h = torch.tanh(self.conv(feats)).transpose(1, 2)  # [n, T/2, width]
        rows = [h[i, : math.ceil(int(n) / 2)] for i, n in enumerate(lengths.tolist())]
        return self.proj(torch.cat(rows))

    def processing(self, modality):
        return AudioProcessing(n_mels=MELS, downsample=2)

    def output_rows(self, media, modality):
        return sum(math.ceil(int(n) / 2) for n in media["lengths"].tolist())

    def dummy_media(self, modality, device):
        return {"features": torch.zeros(1, MELS, 2, device=device),
                "lengths": torch.full((1,), 2, dtype=torch.long, device=device)}

    def init_weights(self, buffer_device=None):
        init.trunc_normal_(self.conv.weight, std=0.3)
        init.zeros_(self.conv.bias)
        init.trunc_normal_(self.proj.weight, std=0.2)
        init.zeros_(self.proj.bias)


# ----------------------------------------------------------------- models
def _plan(moe: bool, encoder_mesh: str = "fsdp") -> OmniParallelPlan:
    parts = [PartLayout("llm", fsdp_units=("tok_embeddings", "layers.*", "output"),
                        ac_units=("layers.*",), gathered_after_forward=("output",))]
    parts.append(
        PartLayout("encoders.vision", fsdp_units=("attn",), mesh=encoder_mesh, ac_units=("attn",))
    )
    parts.append(PartLayout("encoders.audio", mesh=encoder_mesh))
    return OmniParallelPlan(
        parts=tuple(parts),
        sequence_parallel_attention=("llm.layers.*.attention",),
        experts=("llm.layers.*.moe.experts",) if moe else (),
    )


@dataclass
class ModelSpec:
    """What to build: foundation kind, kv heads, encoder mesh."""

    moe: bool = False
    n_heads: int = 4
    n_kv_heads: int = 2
    encoder_mesh: str = "fsdp"
    layers: int = 2
    experts: int = 4
    #: a registered model spec whose "debugmodel" flavor is built instead (the other fields
    #: are then unused)
    zoo: str = ""


def build_model(spec: ModelSpec) -> OmniModel:
    """The tiny omni model described by ``spec`` (on the current default device)."""
    if spec.zoo:
        import torchtitan_omni.models  # noqa: F401  (registers the specs)
        from torchtitan.protocols.train_spec import get_train_spec

        train_spec = get_train_spec(spec.zoo)
        return train_spec.model_cls(train_spec.model_args["debugmodel"])
    if spec.moe:
        llm = Qwen3Moe(
            Qwen3MoeArgs(
                dim=DIM,
                n_layers=spec.layers,
                n_heads=spec.n_heads,
                n_kv_heads=spec.n_kv_heads,
                head_dim=8,
                vocab_size=VOCAB,
                num_experts=spec.experts,
                top_k=2,
                moe_hidden_dim=16,
                max_seq_len=64,
            )
        )
    else:
        llm = Llama3(Llama3Args(
            dim=DIM, n_layers=spec.layers, n_heads=spec.n_heads, n_kv_heads=spec.n_kv_heads,
            vocab_size=VOCAB, ffn_hidden_dim=64, rope_scaling=None, rope_theta=10000.0,
            max_seq_len=64))
    encoders = {"vision": TinyImageEncoder(DIM), "audio": TinyAudioEncoder(DIM)}
    return OmniModel(llm, encoders, plan=_plan(spec.moe, spec.encoder_mesh))


def qwen3_moe_foundation(dim: int, layers: int, experts: int, top_k: int, device: str,
                         dtype: torch.dtype = torch.float32, max_seq_len: int = 4096) -> Qwen3Moe:
    """A Qwen3-MoE foundation alone (4 query and 2 key/value heads of ``dim / 4``, experts of
    ``dim / 2`` hidden), initialized with seed 0, on ``device`` in ``dtype``: the single-block
    checks of compiled and checkpointed MoE layers."""
    model = Qwen3Moe(Qwen3MoeArgs(
        dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, head_dim=dim // 4, vocab_size=512,
        num_experts=experts, top_k=top_k, moe_hidden_dim=dim // 2, max_seq_len=max_seq_len))
    with init.init_context(model, seed=0):
        model.init_weights(torch.device(device))
    return model.to(device=device, dtype=dtype)


def reference_model(spec: ModelSpec, seed: int = 0, device: str = "cpu") -> OmniModel:
    """An unsharded, initialized copy (float32)."""
    with torch.device(device):
        model = build_model(spec)
    model.init_seed = seed
    with torch.no_grad():
        model.init_weights()
    return model


def with_capacity(model: OmniModel, factor: float, tokens: int) -> OmniModel:
    """``model`` with the single-process capacity-padded dispatcher on every MoE layer: the
    reference of a capacity-padded expert-parallel run (the rule depends only on each rank's
    own tokens, so one process reproduces every rank's drops batch by batch)."""
    from torchtitan_omni.modules.moe_capacity import CapacityDispatcher

    for layer in model.llm.layers.values():
        layer.moe.dispatcher = CapacityDispatcher(layer.moe.num_experts, layer.moe.top_k, factor,
                                                  tokens)
    return model


def parallel_model(spec: ModelSpec, dims: OmniParallelDims, cfg, seed: int = 0,
                   device: str = "cpu") -> OmniModel:
    """Built on meta, parallelized by ``parallelize_omni``, materialized and initialized, as
    the trainer does."""
    cfg.omni.init_seed = seed
    with torch.device("meta"):
        model = build_model(spec)
    model = parallelize_omni(model, dims, cfg)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights()
    return model


def make_dims(
    world: int, dp_shard: int = -1, sp: int = 1, ep: int = 1, dp_replicate: int = 1
) -> OmniParallelDims:
    dims = OmniParallelDims(dp_shard=dp_shard, dp_replicate=dp_replicate, cp=sp, tp=1, pp=1,
                            ep=ep, etp=1, world_size=world)
    dims.build_mesh()
    return dims


# ----------------------------------------------------------------- batches
def make_batch(seed: int, rows: int = 2, seq: int = 16, image: bool = True, audio: bool = True,
               min_doc: int = 5) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A packed batch: text documents and documents holding one image or audio clip
    (placeholders mid-document), per-document positions, padding as its own document."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(rows, seq, dtype=torch.long)
    positions = torch.zeros_like(tokens)
    labels = torch.full_like(tokens, B.IGNORE_INDEX)
    img_index = torch.full_like(tokens, -1)
    aud_index = torch.full_like(tokens, -1)
    patches, grids, feats, lengths = [], [], [], []
    bounds, n_img_rows, n_aud_rows = [0], 0, 0
    kinds = [k for k, on in (("image", image), ("audio", audio)) if on]
    for r in range(rows):
        start = 0
        while start < seq:
            room = seq - start
            if room < min_doc:  # padding document
                bounds.append(r * seq + seq)
                break
            n = int(torch.randint(min_doc, max(min_doc + 1, seq * 3 // 4), (1,), generator=g))
            n = min(n, room)
            doc = torch.randint(3, VOCAB, (n,), generator=g)
            kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=g))] if kinds and \
                float(torch.rand(1, generator=g)) < 0.7 else "text"
            media_at = slice(0, 0)
            if kind == "image":
                h, w = 1, int(torch.randint(1, 3, (1,), generator=g))
                k = h * w * 2 if n >= h * w * 2 + 2 else 0
                if k:
                    media_at = slice(1, 1 + k)
                    doc[media_at] = IMAGE_TOKEN
                    img_index[r, start + 1:start + 1 + k] = torch.arange(n_img_rows, n_img_rows + k)
                    n_img_rows += k
                    patches.append(torch.randn(k, PATCH, generator=g))
                    grids.append(torch.tensor([1, h * 2, w]))
            elif kind == "audio":
                frames = int(torch.randint(2, 7, (1,), generator=g))
                k = math.ceil(frames / 2)
                if n >= k + 2:
                    media_at = slice(1, 1 + k)
                    doc[media_at] = AUDIO_TOKEN
                    aud_index[r, start + 1:start + 1 + k] = torch.arange(n_aud_rows, n_aud_rows + k)
                    n_aud_rows += k
                    feats.append(torch.randn(MELS, frames, generator=g))
                    lengths.append(frames)
            tokens[r, start:start + n] = doc
            positions[r, start:start + n] = torch.arange(n)
            lab = torch.cat([doc[1:], torch.tensor([B.IGNORE_INDEX])])
            lab[(lab == IMAGE_TOKEN) | (lab == AUDIO_TOKEN)] = B.IGNORE_INDEX
            labels[r, start:start + n] = lab
            start += n
            bounds.append(r * seq + start)
    batch = {B.INPUT: tokens, B.POSITION_IDS: positions,
             B.CU_SEQLENS: torch.tensor(bounds, dtype=torch.int32),
             B.REAL_TOKENS: torch.tensor(int((tokens != 0).sum()))}
    if patches:
        batch["image_patches"] = torch.cat(patches)
        batch["image_grid_thw"] = torch.stack(grids)
        batch[B.embed_index_key("image")] = img_index
    if feats:
        longest = max(f.shape[1] for f in feats)
        batch["audio_features"] = torch.stack(
            [nn.functional.pad(f, (0, longest - f.shape[1])) for f in feats]
        )
        batch["audio_lengths"] = torch.tensor(lengths)
        batch[B.embed_index_key("audio")] = aud_index
    return batch, labels


def crosses_slices(batch: dict[str, torch.Tensor], degree: int) -> tuple[bool, bool]:
    """(a document crosses an SP slice boundary, a media item does)."""
    seq = batch[B.INPUT].shape[1]
    chunk = seq // degree
    cu = batch[B.CU_SEQLENS].tolist()
    doc = any((a // chunk) != ((b - 1) // chunk) and (a // seq) == ((b - 1) // seq)
              for a, b in zip(cu[:-1], cu[1:]) if b > a)
    media = False
    for key in (B.embed_index_key("image"), B.embed_index_key("audio")):
        if key in batch:
            idx = batch[key]
            for r in range(idx.shape[0]):
                for s in range(1, degree):
                    left, right = idx[r, s * chunk - 1], idx[r, s * chunk]
                    media |= bool(left >= 0 and right >= 0)
    return doc, media


# ----------------------------------------------------------------- steps
def to_device(batch, labels, device):
    """A batch and its labels on ``device``."""
    return {k: v.to(device) for k, v in batch.items()}, labels.to(device)


def _meta(batch: dict[str, torch.Tensor]):
    cu = batch[B.CU_SEQLENS]
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    media = {
        k: v
        for k, v in batch.items()
        if k not in (B.CU_SEQLENS, B.POSITION_IDS, B.INPUT, B.REAL_TOKENS)
    }
    return AttentionMeta(cu, max_seqlen, batch[B.POSITION_IDS]), media


def _loss_fn(aux_weight: float) -> OmniLoss:
    return OmniLoss({}, aux_weight=aux_weight)


def reference_step(model: OmniModel, batches, aux_weight: float = 0.0) -> dict[str, float]:
    """Forward/backward of every data rank's batch in one process, each loss divided by its
    global target count (= one training step over the global batch). Returns the losses."""
    counts: dict[str, torch.Tensor] = {}
    for batch, labels in batches:
        for k, v in model.count_targets(batch, labels).items():
            counts[k] = counts.get(k, 0) + v
    totals: dict[str, float] = {}
    loss_fn = _loss_fn(aux_weight)
    for batch, labels in batches:
        meta, media = _meta(batch)
        out = model(batch[B.INPUT], meta, labels, **media)
        loss, parts = loss_fn(out.losses, counts, {}, 1)
        loss.backward()
        for k, v in parts.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return totals


def parallel_step(model: OmniModel, dims: OmniParallelDims, batch, labels,
                  aux_weight: float = 0.0) -> dict[str, float]:
    """One step on this rank as ``OmniTrainer.train_step`` does it; returns global losses."""
    sp_rank = dims.get_mesh("sp").get_local_rank() if dims.sp_enabled else 0
    batch, labels = shard_sequence(batch, labels, sp_rank, dims.sp)
    loss_mesh = dims.get_optional_mesh("loss")
    local = model.count_targets(batch, labels)
    names = list(local)
    glob = all_reduce(torch.stack([local[n] for n in names]), loss_mesh)
    counts = dict(zip(names, glob))
    meta, media = _meta(batch)
    out = model(batch[B.INPUT], meta, labels, **media)
    contributions = loss_mesh.size() if loss_mesh is not None else 1
    loss, parts = _loss_fn(aux_weight)(out.losses, counts, out.aux_losses, contributions)
    loss.backward()
    names = [n for n in parts if n in counts]
    summed = all_reduce(torch.stack([parts[n].detach() for n in names]), loss_mesh)
    return {n: float(v) for n, v in zip(names, summed)}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (collective: call on all ranks in the same order)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = None
            continue
        out[name] = g.full_tensor() if isinstance(g, DTensor) else g.clone()
    return out


def compare(grads: dict, ref: nn.Module | dict, rtol: float = 1e-5) -> list[str]:
    """Problems (name and relative error) where ``grads`` differ from ``ref``'s gradients
    (``ref``: a module, or another run's :func:`full_grads`)."""
    problems = []
    ref_grads = ({n: p.grad for n, p in ref.named_parameters()} if isinstance(ref, nn.Module)
                 else ref)
    if set(grads) != set(ref_grads):
        return [f"parameter names differ: {sorted(set(grads) ^ set(ref_grads))}"]
    for name, g in grads.items():
        r = ref_grads[name]
        if (g is None) != (r is None):
            problems.append(f"{name}: grad is None on one side only ({g is None}, {r is None})")
            continue
        if g is None:
            continue
        scale = r.abs().max().item()
        err = (g - r).abs().max().item()
        if err > rtol * max(scale, 1e-6):
            problems.append(f"{name}: max error {err:.3e} vs scale {scale:.3e}")
    return problems


def compare_norms(grads: dict, ref: nn.Module, rtol: float) -> list[str]:
    """Like :func:`compare` with the relative error of whole tensors (``|g - r| / |r|``), the
    measure for low-precision runs."""
    problems = []
    for name, p in ref.named_parameters():
        g, r = grads.get(name), p.grad
        if (g is None) != (r is None):
            problems.append(f"{name}: grad is None on one side only")
            continue
        if g is None:
            continue
        err = ((g.float() - r.float()).norm() / r.float().norm().clamp(min=1e-12)).item()
        if err > rtol:
            problems.append(f"{name}: relative error {err:.3e}")
    return problems


def rel_error(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def rank() -> int:
    return dist.get_rank()
