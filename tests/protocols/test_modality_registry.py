"""A modality added entirely from outside the framework: an "imu" sequence of 6-axis float
vectors ``[T, 6]`` per item, with its own processor config, processor and encoder, registered
once with ``register_modality``, and a tiny spec whose encoder declares it. With the default
``data.modalities`` (not naming imu) the data pipeline builds its batch from the spec and the
spec's model trains on it; the registration does not outlive the test."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn as nn

from torchtitan.protocols.train_spec import register_train_spec

from tests.data.helpers import job_config, tokenizer_dir, write_jsonl
from torchtitan_omni.components.inputs import model_inputs
from torchtitan_omni.data import special_tokens as st
from torchtitan_omni.data.loader import build_omni_dataloader, check_data_config, model_processing
from torchtitan_omni.data.processors import Item, Processor, build_processors
from torchtitan_omni.data.sample import parse_row
from torchtitan_omni.data.tokenizer import OmniTokenizer
from torchtitan_omni.foundations.llama3 import Llama3, Llama3Args
from torchtitan_omni.job_model import job_model_args
from torchtitan_omni.model_args import OmniModelArgs
from torchtitan_omni.modules import init
from torchtitan_omni.omni_model import OmniModel
from torchtitan_omni.protocols import batch as B
from torchtitan_omni.protocols.modality import (
    ALL_MODALITIES, Modality, get_modality, modality_names, register_modality, registered,
)
from torchtitan_omni.protocols.modules import OmniEncoder
from torchtitan_omni.spec import omni_train_spec

AXES, DIM = 6, 32


# ----------------------------------------------------------------- the new modality
@dataclass(frozen=True)
class ImuProcessing:
    """IMU clips: ``frames_per_token`` consecutive readings become one LLM token."""

    frames_per_token: int = 2
    max_frames: int = 64

    def num_tokens(self, frames: int) -> int:
        return math.ceil(min(frames, self.max_frames) / self.frames_per_token)


class ImuProcessor(Processor):
    """A JSON list of ``[ax, ay, az, gx, gy, gz]`` readings -> ``values [T, 6]``; batches pad
    to the longest clip (``values [n, T, 6]``, ``lengths [n]``)."""

    def __call__(self, ref, root, source=None):
        values = torch.tensor(ref, dtype=torch.float32)[: self.config.max_frames]
        assert values.ndim == 2 and values.shape[1] == AXES
        return [Item({"values": values}, self.config.num_tokens(values.shape[0]))]

    def collate(self, items):
        lengths = torch.tensor([it.tensors["values"].shape[0] for it in items])
        values = torch.zeros(len(items), int(lengths.max()), AXES)
        for i, it in enumerate(items):
            values[i, : lengths[i]] = it.tensors["values"]
        return {"values": values, "lengths": lengths}


class TinyImuEncoder(OmniEncoder):
    """Pairs of readings -> one LLM row (``ceil(T / 2)`` rows per clip)."""

    modalities = ("imu",)

    def __init__(self, llm_dim: int, width: int = 16) -> None:
        super().__init__()
        self.cfg = ImuProcessing()
        self.embed = nn.Linear(AXES * self.cfg.frames_per_token, width)
        self.proj = nn.Linear(width, llm_dim)

    def lm_encode(self, media, modality):
        k = self.cfg.frames_per_token
        rows = []
        for clip, n in zip(media["values"], media["lengths"].tolist()):
            x = nn.functional.pad(clip[:n], (0, 0, 0, -n % k))
            rows.append(x.reshape(-1, AXES * k))
        return self.proj(torch.tanh(self.embed(torch.cat(rows))))

    def output_rows(self, media, modality):
        return sum(self.cfg.num_tokens(int(n)) for n in media["lengths"].tolist())

    def processing(self, modality):
        return self.cfg

    def dummy_media(self, modality, device):
        return {"values": torch.zeros(1, 2, AXES, device=device),
                "lengths": torch.full((1,), 2, dtype=torch.long, device=device)}

    def init_weights(self, buffer_device=None):
        for lin in (self.embed, self.proj):
            init.trunc_normal_(lin.weight, std=0.2)
            init.zeros_(lin.bias)


IMU = Modality("imu", "input", ImuProcessing, ImuProcessor)


# ----------------------------------------------------------------- a spec whose part reads it
@dataclass
class ImuArgs(OmniModelArgs):
    """A one-layer Llama foundation and the imu encoder; the vocabulary is the tokenizer's."""

    vocab_from_tokenizer: bool = True
    llm: Llama3Args = field(default_factory=lambda: Llama3Args(
        dim=DIM, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=8, ffn_hidden_dim=64,
        rope_scaling=None, max_seq_len=64))

    @property
    def llm_args(self):
        return self.llm

    def build_encoders(self):
        return {"imu": TinyImuEncoder(DIM)}


class ImuModel(OmniModel):
    def __init__(self, args: ImuArgs) -> None:
        super().__init__(Llama3(args.llm), encoders=args.build_encoders())


SPEC = "imu_omni"
try:
    register_train_spec(SPEC, omni_train_spec(ImuModel, {"tiny": ImuArgs()}))
except ValueError:  # already registered in this process
    pass


def _imu_job(tokenizer: str) -> tuple[str, ...]:
    return ("--model.name", SPEC, "--model.flavor", "tiny", "--model.hf_assets_path", tokenizer)


@pytest.fixture
def imu():
    """The imu modality, registered for one test only."""
    with registered(IMU) as modality:
        yield modality


# ----------------------------------------------------------------- tests
def test_builtins_are_registered_in_token_order():
    assert modality_names()[:4] == B.MODALITIES
    assert get_modality(B.GEN_IMAGE).is_target and not get_modality(B.AUDIO).is_target
    assert get_modality(B.IMAGE).keys == ("images", "image")
    assert st.placeholders()[B.GEN_IMAGE] == "<gen_image>"
    assert st.omni_tokens() == st.ORDER  # nothing but the built-ins outside a registration


def test_registration_is_scoped_and_checked(imu):
    assert "imu" in modality_names() and imu.placeholder == "<imu>"
    assert imu.keys == ("imus", "imu") and imu.tokens[1] == "<|imu_pad|>"
    assert st.omni_tokens() == st.ORDER + imu.tokens  # appended after the frozen built-ins
    with pytest.raises(ValueError, match="already registered"):
        register_modality(Modality("imu", "target"))
    with pytest.raises(ValueError, match="placeholder or row key"):
        register_modality(Modality("imu2", keys=("imus",)))
    assert type(build_processors({"imu": ImuProcessing()})["imu"]) is ImuProcessor


def test_a_replaced_builtin_comes_back_in_place():
    names, audio = modality_names(), get_modality(B.AUDIO)
    with registered(Modality(B.AUDIO, placeholder="<sound>"), replace=True):
        assert st.placeholders()[B.AUDIO] == "<sound>" and modality_names() == names
        assert parse_row({"text": "hear <sound>", "audio": "a.wav"}, None).media == {
            B.AUDIO: ["a.wav"]}
    assert get_modality(B.AUDIO) is audio and modality_names() == names
    assert parse_row({"text": "hear <audio>", "audio": "a.wav"}, None).media


def test_unregistered_after_the_fixture():
    assert "imu" not in modality_names()
    with pytest.raises(ValueError, match="unknown"):
        check_data_config(job_config("--data.modalities", "imu").data, 64)


def test_data_modalities_default_to_what_the_parts_declare(imu, tmp_path):
    folder = tokenizer_dir(tmp_path)
    assert model_processing(job_config(*_imu_job(folder))) == {"imu": ImuProcessing()}
    # an explicit list still restricts: only the declared modalities it names
    assert model_processing(job_config(*_imu_job(folder), "--data.modalities", "imu")) == {
        "imu": ImuProcessing()}
    assert model_processing(job_config(*_imu_job(folder), "--data.modalities", "image")) == {}
    with pytest.raises(ValueError, match=r"data.modalities: 'all' .* stands alone, got "
                                         r"\['all', 'imu'\]"):
        check_data_config(job_config("--data.modalities", "all,imu").data, 64)
    with pytest.raises(ValueError, match="modality name 'all' is reserved"):
        Modality(ALL_MODALITIES)


def test_token_ids_of_the_builtins_do_not_move(tmp_path):
    folder = tokenizer_dir(tmp_path)
    before = OmniTokenizer(folder)
    with registered(IMU):
        after = OmniTokenizer(folder)
    assert {m: after.special.media[m] for m in B.MODALITIES} == before.special.media
    assert after.special.mapping.items() >= before.special.mapping.items()
    base = before.layout.size
    assert after.special.media["imu"] == (base, base + 1, base + 2)
    assert after.layout.added == before.layout.added + IMU.tokens


def test_parse_row_reads_the_registered_keys_and_placeholder(imu):
    clip = [[0.0] * AXES] * 3
    sample = parse_row({"text": "walking <imu> then", "imus": [clip]}, None)
    assert sample.media == {"imu": [clip]}
    row = {"messages": [{"role": "user", "content": [
        {"type": "imu", "imu": clip}, {"type": "text", "text": "what motion?"}]},
        {"role": "assistant", "content": "walking"}]}
    assert parse_row(row, None).media == {"imu": [clip]}


def _clip(frames: int, seed: int) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(frames, AXES, generator=g).round(decimals=3).tolist()


def test_pipeline_batch_and_a_training_step(imu, tmp_path):
    """The trainer's path with the default ``data.modalities`` (not listing imu): the loader
    takes the processing configs the spec's parts declare, the model comes from the spec."""
    root = tmp_path / "ds"
    rows = [
        {"messages": [{"role": "user", "content": "<imu>What is the wearer doing?"},
                      {"role": "assistant", "content": "walking"}], "imus": [_clip(5, k)]}
        for k in range(4)
    ] + [{"text": "a small corpus <imu> of words", "imu": _clip(4, 9)}]
    write_jsonl(root / "train.jsonl", rows)
    folder = tokenizer_dir(tmp_path)
    tok = OmniTokenizer(folder)
    cfg = job_config(*_imu_job(folder), "--training.dataset", "custom",
                     "--training.dataset_path", str(root), "--training.seq_len", "64",
                     "--training.local_batch_size", "2", "--data.buffer_docs", "8")
    assert cfg.data.modalities == [ALL_MODALITIES]
    check_data_config(cfg.data, 64)
    loader = build_omni_dataloader(1, 0, tok, cfg)
    batch, labels = next(iter(loader))
    torch.manual_seed(0)
    args = job_model_args(cfg)
    assert args.llm_args.vocab_size == tok.layout.size
    model = ImuModel(args)
    encoder = model.encoders["imu"]

    index = batch[B.embed_index_key("imu")]
    media = B.media(batch, "imu")
    assert set(media) == {"values", "lengths"} and media["values"].shape[-1] == AXES
    assert int((index >= 0).sum()) == encoder.output_rows(media, "imu") > 0
    pad = tok.special.media_ids("imu")[1]
    assert torch.equal(batch[B.INPUT] == pad, index >= 0)
    assert B.target_index_key("imu") not in batch  # an input, not a generation target

    model.init_weights()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = encoder.proj.weight.detach().clone()
    tokens, meta, labels, media_in, _ = model_inputs(batch, labels, torch.device("cpu"))
    out = model(tokens, meta, labels, **media_in)
    loss = sum(out.losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in encoder.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    opt.step()
    assert not torch.equal(encoder.proj.weight, before)
