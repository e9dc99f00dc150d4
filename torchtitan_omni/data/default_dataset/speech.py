"""Synthesized speech for the bundled dataset: eSpeak NG (bundled by the ``espeakng-loader``
wheel) driven through ctypes, at its native 22.05 kHz (the pipeline resamples to 16 kHz)."""

from __future__ import annotations

import ctypes

import numpy as np

_SYNCHRONOUS = 2  # AUDIO_OUTPUT_SYNCHRONOUS
_POS_CHARACTER = 1
_RATE = 1  # espeakRATE
_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class Speaker:
    """Text -> int16 waveform with eSpeak NG. One per process (the library is global)."""

    def __init__(self) -> None:
        try:
            import espeakng_loader  # noqa: PLC0415  (its absence is reported with the fix)
        except ImportError as e:
            raise ImportError(
                "the bundled dataset's speech needs the espeakng-loader wheel: "
                "pip install espeakng-loader"
            ) from e
        self._lib = ctypes.CDLL(espeakng_loader.get_library_path())
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
