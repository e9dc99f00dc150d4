"""Synthesized speech for the bundled dataset: eSpeak NG (bundled by the ``espeakng-loader``
wheel) driven through ctypes, at its native 22.05 kHz (the pipeline resamples to 16 kHz).

eSpeak NG is not reproducible as it comes: ``espeak_Initialize`` seeds the noise of breathy
voices (the ``+f2``/``+f3`` variants) with the time of day, and synthesis carries state from one
utterance to the next in static variables that no call resets (pitch flutter phase, gain
control, glottal cycle count, filter memories). A :class:`Speaker` therefore loads its own copy
of the library (fresh state whatever the process synthesized before) and reseeds the noise
before every utterance: the same utterances said in the same order give the same bytes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import tempfile

import numpy as np

_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS
_POS_CHARACTER = 1
_RATE = 1  # espeakRATE
_NOISE_SEED = 0  # espeak_ng_SetRandSeed before each utterance
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


def _private_library(path: str) -> ctypes.CDLL:
    """A copy of the shared library at ``path``, loaded apart from any other: its own static
    (synthesis) state. The mapping outlives the copied file."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = os.path.join(tmp, os.path.basename(path))
        shutil.copyfile(path, copy)
        return ctypes.CDLL(copy)


class Speaker:
    """Text -> int16 waveform with eSpeak NG, on a private copy of the library: its output
    depends only on the utterances it said before (see the module docstring)."""

    def __init__(self) -> None:
        try:
            import espeakng_loader  # noqa: PLC0415  (its absence is reported with the fix)
        except ImportError as e:
            raise ImportError(
                "the bundled dataset's speech needs the espeakng-loader wheel: "
                "pip install espeakng-loader"
            ) from e
        self._lib = _private_library(espeakng_loader.get_library_path())
        if not hasattr(self._lib, "espeak_ng_SetRandSeed"):  # eSpeak NG < 1.52
            raise ImportError(
                "the bundled dataset's speech needs eSpeak NG 1.52 or later "
                "(espeak_ng_SetRandSeed, for reproducible breathy voices): "
                "pip install -U espeakng-loader"
            )
        self._lib.espeak_Initialize.restype = ctypes.c_int
        self.sample_rate = self._lib.espeak_Initialize(
            _SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), 0
        )
        if self.sample_rate <= 0:
            raise RuntimeError("eSpeak NG failed to initialize")
        self._chunks: list[np.ndarray] = []
        self._callback = _CALLBACK(self._collect)  # kept alive as long as the speaker
        self._lib.espeak_SetSynthCallback(self._callback)

    def _collect(self, wav, n, events) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        return 0

    def say(self, text: str, voice: str = "en-us", rate: int = 175) -> np.ndarray:
        """The waveform (int16, ``sample_rate`` Hz) of ``text`` spoken by ``voice``."""
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}")
        self._lib.espeak_SetParameter(_RATE, int(rate), 0)
        self._lib.espeak_ng_SetRandSeed(_NOISE_SEED)  # else: seeded by the clock at init
        self._chunks = []
        data = text.encode()
        err = self._lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, 0, None, None)
        self._lib.espeak_Synchronize()
        if err != 0 or not self._chunks:
            raise RuntimeError(f"eSpeak NG could not speak {text!r} (error {err})")
        return np.concatenate(self._chunks)


def number_words(n: int) -> str:
    """English words for 0 <= n < 100."""
    ones = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
            "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
            "seventeen", "eighteen", "nineteen")
    tens = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
    if n < 20:
        return ones[n]
    return tens[n // 10] + ("" if n % 10 == 0 else " " + ones[n % 10])
