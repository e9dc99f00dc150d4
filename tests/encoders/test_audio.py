"""Whisper-style audio encoder: rows per clip match the processor, padding never leaks, and
parity with Hugging Face's Whisper encoder and Qwen2-Audio's audio tower on full-length clips
(where Whisper's fixed 30 s window and our per-clip attention must agree)."""

import pytest
import torch

from tests.encoders.hf_utils import (
    check_init_covers_everything, load_with_adapter, randomize_, rel_err, write_hf_checkpoint,
)
from torchtitan_omni.encoders.audio import FRAME_BUCKET, AudioArgs, AudioEncoder, sinusoids
from torchtitan_omni.modules.init import init_context

LLM_DIM = 24
N_MELS = 16
HF_POSITIONS = 16  # the tiny HF encoders take 2 * 16 = 32 mel frames


def tiny_args(**kw) -> AudioArgs:
    # 0.32 s chunks: 5120 samples -> 33 mel frames -> 17 positions after the strided conv
    base = dict(n_mels=N_MELS, dim=32, n_layers=2, n_heads=4, mlp_dim=64, chunk_seconds=0.32)
    base.update(kw)
    return AudioArgs(**base)


def build(dtype=torch.float64) -> AudioEncoder:
    enc = AudioEncoder(tiny_args(), LLM_DIM)
    with init_context(enc, seed=0):
        enc.init_weights()
    return randomize_(enc, seed=1).to(dtype)


def padded(clips):
    t = max(c.shape[1] for c in clips)
    feats = torch.zeros(len(clips), N_MELS, t, dtype=clips[0].dtype)
    for i, c in enumerate(clips):
        feats[i, :, : c.shape[1]] = c
    return {"features": feats, "lengths": torch.tensor([c.shape[1] for c in clips])}


def test_rows_match_processor_and_padding_never_leaks():
    enc = build()
    proc = enc.processing("audio")
    assert proc.downsample == 4 and proc.n_mels == N_MELS
    g = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 4, 5, 7, 8, 13, 33]
    clips = [torch.randn(N_MELS, n, generator=g, dtype=torch.float64) for n in lengths]
    media = padded(clips)
    out = enc(media, "audio")
    assert out.shape == (sum(proc.num_tokens(n) for n in lengths), LLM_DIM)

    single = torch.cat([enc(padded([c]), "audio") for c in clips])
    assert torch.allclose(out, single, rtol=0, atol=1e-12)

    garbage = media["features"].clone()
    for i, n in enumerate(lengths):
        garbage[i, :, n:] = 1e3 * torch.randn(
            N_MELS, garbage.shape[2] - n, generator=g, dtype=torch.float64
        )
    assert torch.equal(enc({"features": garbage, "lengths": media["lengths"]}, "audio"), out)


def test_sinusoids_match_whisper():
    from transformers.models.whisper.modeling_whisper import sinusoids as hf_sinusoids

    assert torch.allclose(sinusoids(1501, 64), hf_sinusoids(1501, 64), rtol=0, atol=1e-6)


def _hf_full_length_input():
    return torch.randn(2, N_MELS, 2 * HF_POSITIONS, generator=torch.Generator().manual_seed(5))


def test_matches_hf_whisper_encoder(tmp_path):
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    cfg = WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                        num_mel_bins=N_MELS, max_source_positions=HF_POSITIONS)
    torch.manual_seed(0)
    hf = WhisperEncoder(cfg)
    table = hf.embed_positions.weight.detach().clone()  # keep the sinusoid table as Whisper's
    randomize_(hf, seed=2).eval()
    with torch.no_grad():
        hf.embed_positions.weight.copy_(table)
    path = tmp_path / "model.safetensors"
    write_hf_checkpoint(hf, path, prefix="model.encoder.")

    enc = AudioEncoder(tiny_args(), LLM_DIM)
    adapter = enc.hf_adapter()
    missing, unused = load_with_adapter(enc, adapter, path)
    assert adapter.init_only() == ("projector.*",)  # not in Whisper: keeps its init
    assert missing == set() and unused == set()

    feats = _hf_full_length_input()
    with torch.no_grad():
        ref = hf(feats).last_hidden_state
        frames, _ = enc.frames(feats, torch.full((2,), feats.shape[2]))
        ours = enc.norm(frames).reshape(ref.shape)  # Whisper: final norm, no pooling
    assert rel_err(ours, ref) < 1e-5


def test_matches_hf_qwen2_audio_tower_and_projector(tmp_path):
    from transformers import Qwen2AudioEncoderConfig
    from transformers.models.qwen2_audio.modeling_qwen2_audio import Qwen2AudioEncoder

    cfg = Qwen2AudioEncoderConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4,
                                  encoder_ffn_dim=64, num_mel_bins=N_MELS,
                                  max_source_positions=HF_POSITIONS)
    torch.manual_seed(0)
    from transformers.models.whisper.modeling_whisper import sinusoids as hf_sinusoids

    tower = randomize_(Qwen2AudioEncoder(cfg), seed=3).eval()
    with torch.no_grad():  # real Qwen2-Audio checkpoints keep Whisper's frozen sinusoid table
        tower.embed_positions.weight.copy_(hf_sinusoids(HF_POSITIONS, 32))
    projector = randomize_(torch.nn.Linear(32, LLM_DIM), seed=4)
    tensors = {
        **{f"audio_tower.{k}": v for k, v in tower.state_dict().items()},
        **{f"multi_modal_projector.linear.{k}": v for k, v in projector.state_dict().items()},
    }
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))

    enc = AudioEncoder(tiny_args(hf_format="qwen2_audio"), LLM_DIM)
    missing, unused = load_with_adapter(enc, enc.hf_adapter(), path)
    assert missing == set() and unused == set()

    feats = _hf_full_length_input()
    with torch.no_grad():
        ref = projector(tower(feats).last_hidden_state).flatten(0, 1)
        ours = enc({"features": feats, "lengths": torch.full((2,), feats.shape[2])}, "audio")
    assert rel_err(ours, ref) < 1e-5


def test_dummy_media_init_and_errors():
    enc = AudioEncoder(tiny_args(), LLM_DIM)
    check_init_covers_everything(enc)
    assert enc(enc.dummy_media("audio", torch.device("cpu")), "audio").shape == (1, LLM_DIM)
    feats = torch.zeros(2, N_MELS, 10)
    with pytest.raises(ValueError, match=r"audio_lengths\[1\] = 11 is outside \[1, 10\]"):
        enc({"features": feats, "lengths": torch.tensor([4, 11])}, "audio")
    with pytest.raises(ValueError, match="audio_lengths must be \\[n\\] with n = 2"):
        enc({"features": feats, "lengths": torch.tensor([4])}, "audio")
    with pytest.raises(ValueError, match="more than the 34 of a 0.32 s chunk"):
        enc({"features": torch.zeros(1, N_MELS, 40), "lengths": torch.tensor([40])}, "audio")
    with pytest.raises(ValueError, match=r"audio_features must be \[n, 16, T\]"):
        enc({"features": torch.zeros(1, 8, 10), "lengths": torch.tensor([4])}, "audio")


def test_stem_lengths_are_rounded_to_buckets_without_changing_rows():
    """The convolutions see the longest clip rounded up to FRAME_BUCKET mel frames (capped at
    the longest clip the encoder takes), so lengths repeat across batches; the rows equal each
    clip encoded alone."""
    enc = AudioEncoder(tiny_args(chunk_seconds=3.0), LLM_DIM)  # 301 frames -> limit 302
    with init_context(enc, seed=0):
        enc.init_weights()
    enc = randomize_(enc, seed=1).to(torch.float64)
    seen = []
    hook = enc.conv1.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[2]))
    g = torch.Generator().manual_seed(3)
    for lengths, want in (([50, 130], 2 * FRAME_BUCKET), ([7], FRAME_BUCKET), ([290], 302)):
        clips = [torch.randn(N_MELS, n, generator=g, dtype=torch.float64) for n in lengths]
        seen.clear()
        out = enc(padded(clips), "audio")
        assert seen[0] == want
        alone = torch.cat([enc(padded([c]), "audio") for c in clips])
        assert torch.allclose(out, alone, rtol=0, atol=1e-12)
    hook.remove()
