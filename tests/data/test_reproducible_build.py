"""The bundled dataset is byte-reproducible for a seed: its speech (eSpeak NG) and its video
(PyAV/x264), the two parts that were not, give the same bytes when made again, in this process
after other work, in a fresh process, and whatever the heap or the CPU's SIMD."""

import ctypes
import ctypes.util
import hashlib
import json
import random
import re
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("espeakng_loader")

from torchtitan_omni.data.default_dataset import (  # noqa: E402
    build, clips, realistic, speech, vision,
)

# the build's utterances, in its order, 16 per split: every voice, breathy ones (+f2, +f3) too
UTTERANCES = [(text, voice, rate) for split, i, text, voice, rate, _ in build.speech_utterances(0)
              if i < 16]

_SAY_IN_A_FRESH_PROCESS = """
import hashlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("fresh_speech", sys.argv[1])
speech = importlib.util.module_from_spec(spec)
spec.loader.exec_module(speech)
speaker = speech.Speaker()
print(json.dumps([hashlib.sha256(speaker.say(*u).tobytes()).hexdigest()
                  for u in json.loads(sys.stdin.read())]))
"""


def _say_all(speaker: speech.Speaker) -> list[str]:
    return [hashlib.sha256(speaker.say(*u).tobytes()).hexdigest() for u in UTTERANCES]


def test_speech_is_the_same_in_every_speaker_and_process():
    """A fresh speaker says the build's utterances the same: after another speaker said them
    in this process (eSpeak NG keeps synthesis state in statics no call resets), at another
    second of the clock (eSpeak NG seeds its breath noise with the time at initialization),
    and in a fresh process."""
    assert {v for _, v, _ in UTTERANCES} == {v for vs in build.VOICES.values() for v in vs}
    first = _say_all(speech.Speaker())
    time.sleep(1.02 - time.time() % 1)  # the next speaker initializes at another second
    again = _say_all(speech.Speaker())
    fresh = subprocess.run(
        [sys.executable, "-c", _SAY_IN_A_FRESH_PROCESS, speech.__file__],
        input=json.dumps(UTTERANCES), capture_output=True, text=True, check=True, timeout=120,
    )
    assert len(set(first)) == len(UTTERANCES)
    assert again == first
    assert json.loads(fresh.stdout) == first


def _moving_digits(n: int) -> list[np.ndarray]:
    rng, bank = random.Random("0-video-train"), vision.digit_bank("train")
    return [clips.moving_digit(rng, bank)[0] for _ in range(n)]


def _encode_all(frames: list[np.ndarray], tmp_path) -> list[str]:
    out = []
    for i, f in enumerate(frames):
        path = tmp_path / f"{i}.mp4"
        clips.write_mp4(str(path), f, 4)
        out.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return out


@contextmanager
def _heap_filled_with(byte: int):
    """glibc fills new heap blocks with ``byte ^ 0xff``: code that reads memory it did not write
    sees other values under another byte."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallopt"):
        pytest.skip("not glibc: no mallopt(M_PERTURB)")
    libc.mallopt(-6, byte)  # M_PERTURB
    try:
        yield
    finally:
        libc.mallopt(-6, 0)


def _libavutil() -> ctypes.CDLL:
    """The libavutil PyAV loaded (its wheels bundle FFmpeg under a hashed name)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libavutil" in line}
    if len(paths) != 1:
        pytest.skip(f"cannot tell PyAV's libavutil among {sorted(paths)}")
    return ctypes.CDLL(paths.pop())


def test_mp4_is_the_same_whatever_the_heap_and_the_cpu(tmp_path):
    """The same frames give the same mp4 bytes: when fresh heap memory holds other values (x264's
    CPU-specific intra analysis read uninitialized memory: the same clip encoded twice could
    differ) and without FFmpeg's SIMD (swscale's SIMD rounds RGB -> YUV differently from its C
    code: another CPU gave other bytes)."""
    frames = _moving_digits(40)
    with _heap_filled_with(0x01):
        first = _encode_all(frames, tmp_path)
    with _heap_filled_with(0xFE):
        again = _encode_all(frames, tmp_path)
    assert again == first
    avutil = _libavutil()
    avutil.av_force_cpu_flags(0)  # FFmpeg's plain C code, as on a CPU without SIMD
    try:
        without_simd = _encode_all(frames, tmp_path)
    finally:
        avutil.av_force_cpu_flags(-1)  # detect again
    assert without_simd == first


def test_mp4_encodes_on_one_thread_whatever_the_cores(tmp_path):
    """x264's output depends on its thread count, which by default follows the machine's cores
    for frames of the realistic workload's sizes (the bundled 32 px clips get one thread
    anyway). x264 writes the count it used into the stream."""
    frames = realistic.bouncing_digits(random.Random(0), vision.digit_bank("train"), 256, 320, 4)
    path = tmp_path / "big.mp4"
    clips.write_mp4(str(path), frames, 4)
    assert re.search(rb" threads=(\d+) ", path.read_bytes()).group(1) == b"1"


@pytest.mark.parametrize("shape", [(32, 32), (48, 64)])
def test_yuv420p_frames_decode_to_the_pixels(tmp_path, shape):
    h, w = shape
    rng = np.random.default_rng(0)
    frames = np.repeat(rng.integers(0, 256, (4, h // 8, w // 8, 3), np.uint8), 8, 1).repeat(8, 2)
    assert clips.yuv420p(frames[0]).shape == (h * 3 // 2, w)
    path = tmp_path / "clip.mp4"
    clips.write_mp4(str(path), frames, 4)
    with av.open(str(path)) as container:
        decoded = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    assert decoded.shape == frames.shape
    assert np.abs(decoded.astype(int) - frames).mean() < 12
