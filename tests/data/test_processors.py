"""Each media processor against an independent reference: Hugging Face's Qwen2-VL image
processor and Whisper feature extractor, analytic signals, and hand-made videos."""

import numpy as np
import pytest
import torch
from PIL import Image

from tests.data.helpers import write_mp4, write_png, write_wav
from torchtitan_omni.data.bad_samples import Source
from torchtitan_omni.data.processors import (
    AudioProcessor, GenImageProcessor, ImageProcessor, VideoProcessor, build_processors,
)
from torchtitan_omni.data.processors.audio import log_mel, mel_filters, resample
from torchtitan_omni.data.processors.image import patchify
from torchtitan_omni.protocols.processing import (
    AudioProcessing, GenImageProcessing, ImageProcessing, VideoProcessing,
)

SRC = Source("test.jsonl", 0)


def _hf_qwen2vl(**kw):
    transformers = pytest.importorskip("transformers")
    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
    if cls is None:
        from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as m

        cls = m.Qwen2VLImageProcessorPil
    return cls(**kw)


@pytest.mark.parametrize("hw", [(16, 24), (40, 16)])
def test_image_patches_match_hugging_face_qwen2vl(tmp_path, hw):
    cfg = ImageProcessing(patch_size=4, merge_size=2, temporal_patch_size=2,
                          min_pixels=8 * 8, max_pixels=32 * 32)
    h, w = cfg.resized_hw(*hw)
    path = write_png(tmp_path / "a.png", h, w, seed=hw[0])  # already at the target size
    item, = ImageProcessor(cfg)(path, str(tmp_path), SRC)
    hf = _hf_qwen2vl(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                     max_pixels=1024, image_mean=list(cfg.mean), image_std=list(cfg.std))
    ref = hf(images=[np.asarray(Image.open(path))], return_tensors="np")
    assert item.tensors["grid_thw"].tolist() == ref["image_grid_thw"][0].tolist()
    np.testing.assert_allclose(item.tensors["patches"].numpy(), ref["pixel_values"], atol=1e-5)
    assert item.num_tokens == item.tensors["patches"].shape[0] // 4 == cfg.num_tokens(h, w)


def test_image_resize_then_patches_match_hugging_face(tmp_path):
    cfg = ImageProcessing(patch_size=4, merge_size=2, temporal_patch_size=2,
                          min_pixels=8 * 8, max_pixels=24 * 24)
    path = write_png(tmp_path / "big.png", 50, 37, seed=3)
    item, = ImageProcessor(cfg)(path, str(tmp_path), SRC)
    hf = _hf_qwen2vl(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=64,
                     max_pixels=576, image_mean=list(cfg.mean), image_std=list(cfg.std))
    ref = hf(images=[np.asarray(Image.open(path))], return_tensors="np")
    assert item.tensors["grid_thw"].tolist() == ref["image_grid_thw"][0].tolist()
    # Both resize bicubically with PIL; allow for rounding differences of the uint8 round trip.
    diff = np.abs(item.tensors["patches"].numpy() - ref["pixel_values"])
    assert diff.mean() < 0.02 and diff.max() < 0.1, (diff.mean(), diff.max())


def test_patch_order_is_merge_window_major():
    """Each patch's top-left pixel encodes its (t, y, x) grid cell: check the order by loops."""
    p, m, tp = 2, 2, 2
    t, gh, gw = 2, 4, 6
    pixels = torch.zeros(t * tp, 3, gh * p, gw * p)
    for f in range(t * tp):
        for y in range(gh):
            for x in range(gw):
                pixels[f, :, y * p:(y + 1) * p, x * p:(x + 1) * p] = (f // tp) * 1000 + y * 10 + x
    patches, grid = patchify(pixels, p, m, tp)
    assert grid.tolist() == [t, gh, gw]
    expected = []
    for tt in range(t):
        for wy in range(gh // m):
            for wx in range(gw // m):
                for iy in range(m):
                    for ix in range(m):
                        expected.append(tt * 1000 + (wy * m + iy) * 10 + (wx * m + ix))
    assert patches[:, 0].tolist() == expected
    assert patches.shape == (t * gh * gw, 3 * tp * p * p)


def test_fixed_size_mode(tmp_path):
    cfg = ImageProcessing(
        mode="fixed", image_size=12, patch_size=4, mean=(0.5,) * 3, std=(0.5,) * 3
    )
    path = write_png(tmp_path / "a.png", 12, 12, seed=1)
    item, = ImageProcessor(cfg)(path, str(tmp_path), SRC)
    ref = torch.from_numpy(np.asarray(Image.open(path), dtype=np.float64) / 255.0)
    ref = ((ref - 0.5) / 0.5).permute(2, 0, 1)
    torch.testing.assert_close(item.tensors["pixels"].double(), ref, atol=1e-6, rtol=0)
    assert item.num_tokens == 9
    big = ImageProcessor(cfg)(write_png(tmp_path / "b.png", 30, 20), str(tmp_path), SRC)[0]
    assert big.tensors["pixels"].shape == (3, 12, 12)
    batch = ImageProcessor(cfg).collate([item, big])
    assert batch["pixels"].shape == (2, 3, 12, 12)


def _clip(n_frames: int, size: int = 16) -> np.ndarray:
    """Frames whose gray level is 10 + 15 * index (mod 256; robust to lossy coding)."""
    return np.stack(
        [np.full((size, size, 3), (10 + 15 * i) % 256, np.uint8) for i in range(n_frames)]
    )


def test_video_frames_fps_and_temporal_grouping(tmp_path):
    cfg = VideoProcessing(patch_size=4, merge_size=2, temporal_patch_size=2, fps=2.0,
                          max_frames=8, min_pixels=8 * 8, max_pixels=16 * 16,
                          mean=(0.0,) * 3, std=(1.0,) * 3)
    path = write_mp4(tmp_path / "v.mp4", _clip(16), fps=8)  # 2 s at 8 fps
    item, = VideoProcessor(cfg)(path, str(tmp_path), SRC)
    # 2 s at 2 fps -> 4 frames, uniformly over the 16 frames: 0, 5, 10, 15
    grid = item.tensors["grid_thw"].tolist()
    assert grid == [2, 4, 4]
    patches = item.tensors["patches"].reshape(2, 4, 4, 3, 2, 4, 4)  # t, win..., c, tp, p, p
    levels = patches[:, 0, 0, 0, :, 0, 0].reshape(-1) * 255  # first patch, channel 0, per frame
    expected = torch.tensor([10 + 15 * i for i in (0, 5, 10, 15)], dtype=torch.float32)
    torch.testing.assert_close(levels, expected, atol=4.0, rtol=0)
    assert item.num_tokens == cfg.num_tokens(16, 16, 4) == 2 * 4 * 4 // 4


def test_video_long_clip_capped_and_short_clip_padded(tmp_path):
    cfg = VideoProcessing(patch_size=4, merge_size=2, temporal_patch_size=2, fps=4.0,
                          max_frames=4, min_pixels=8 * 8, max_pixels=16 * 16)
    long, = VideoProcessor(cfg)(write_mp4(tmp_path / "l.mp4", _clip(40), 8), str(tmp_path), SRC)
    assert long.tensors["grid_thw"][0].item() == 2  # max_frames 4 -> 2 temporal groups
    short, = VideoProcessor(cfg)(write_mp4(tmp_path / "s.mp4", _clip(1), 8), str(tmp_path), SRC)
    assert short.tensors["grid_thw"][0].item() == 1  # one frame repeated to a group of 2


def test_resampling_matches_analytic_signal():
    tones = [(440.0, 0.5), (1250.0, 0.3), (3100.0, 0.2)]  # below 8 kHz: survive 16 kHz

    def signal(rate, seconds=0.5):
        t = np.arange(int(rate * seconds)) / rate
        return sum(a * np.sin(2 * np.pi * f * t) for f, a in tones)

    for rate in (22050, 44100, 8000 * 3):
        out = resample(signal(rate).astype(np.float32), rate, 16000)
        ref = signal(16000)
        assert abs(out.shape[0] - ref.shape[0]) <= 1
        n = min(out.shape[0], ref.shape[0])
        inner = slice(400, n - 400)  # filter edge effects
        assert np.abs(out[:n][inner] - ref[:n][inner]).max() < 5e-3


def test_log_mel_matches_whisper_feature_extractor():
    transformers = pytest.importorskip("transformers")
    cfg = AudioProcessing()
    rng = np.random.default_rng(0)
    t = np.arange(16000 * 2) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 300 * t) + 0.05 * rng.standard_normal(t.shape)).astype(
        np.float32
    )
    ours = log_mel(wave, cfg).numpy()
    assert ours.shape == (80, cfg.num_frames(wave.shape[0]))
    fe = transformers.WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160,
                                              n_fft=400, chunk_length=30)
    ref = fe(wave.astype(np.float64), sampling_rate=16000, return_tensors="np")["input_features"][0]
    # Whisper pads to 30 s with zeros; frames whose window lies inside the clip must agree.
    inner = (wave.shape[0] - 200) // 160
    np.testing.assert_allclose(ours[:, 2:inner], ref[:, 2:inner], atol=2e-4)


def test_mel_filters_match_librosa_formula_in_transformers():
    audio_utils = pytest.importorskip("transformers.audio_utils")
    ref = audio_utils.mel_filter_bank(num_frequency_bins=201, num_mel_filters=80, min_frequency=0.0,
                                      max_frequency=8000.0, sampling_rate=16000, norm="slaney",
                                      mel_scale="slaney")
    np.testing.assert_allclose(mel_filters(16000, 400, 80).numpy(), ref.T, rtol=1e-5, atol=1e-7)


def test_audio_resampled_chunked_and_collated(tmp_path):
    cfg = AudioProcessing(chunk_seconds=1.0)
    proc = AudioProcessor(cfg)
    items = proc(write_wav(tmp_path / "a.wav", 2.5, rate=22050), str(tmp_path), SRC)
    lengths = [it.tensors["lengths"].item() for it in items]
    assert lengths == [cfg.num_frames(16000), cfg.num_frames(16000), cfg.num_frames(8000)]
    assert [it.num_tokens for it in items] == [cfg.num_tokens(n) for n in lengths]
    batch = proc.collate(items)
    assert batch["features"].shape == (3, 80, max(lengths))
    assert batch["lengths"].tolist() == lengths
    assert (batch["features"][2, :, lengths[2]:] == 0).all()


def test_gen_image_pixels(tmp_path):
    cfg = GenImageProcessing(image_size=8, downsample=4)
    path = write_png(tmp_path / "g.png", 8, 8, seed=5)
    item, = GenImageProcessor(cfg)(path, str(tmp_path), SRC)
    ref = (
        torch.from_numpy(np.asarray(Image.open(path), dtype=np.float64)).permute(2, 0, 1) / 127.5
        - 1
    )
    torch.testing.assert_close(item.tensors["pixels"].double(), ref, atol=1e-6, rtol=0)
    assert item.num_tokens == 4
    wide, = GenImageProcessor(cfg)(write_png(tmp_path / "w.png", 10, 30), str(tmp_path), SRC)
    px = wide.tensors["pixels"]
    assert px.shape == (3, 8, 8) and px.min() >= -1 and px.max() <= 1


def test_build_processors_picks_by_config_type():
    procs = build_processors({
        "image": ImageProcessing(), "video": VideoProcessing(), "audio": AudioProcessing(),
        "gen_image": GenImageProcessing(),
    })
    assert [type(p).__name__ for p in procs.values()] == [
        "ImageProcessor", "VideoProcessor", "AudioProcessor", "GenImageProcessor"]
    with pytest.raises(TypeError, match="image"):
        build_processors({"image": object()})
