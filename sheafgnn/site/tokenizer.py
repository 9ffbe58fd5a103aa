"""Tokenizers: text to token ids and back, and each id's bytes.

The site builder finds its patches (sentences, brackets, words, ...) on the
*byte* stream, so a tokenizer also says which bytes each id stands for
(:meth:`token_bytes`). For the byte tokenizer an id is its byte; a BPE id is
the UTF-8 bytes of its piece.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

MAX_TEXT_BYTES = 1 << 30  # 1 GiB: refuse anything larger with a clear message


def bytes_tensor(data: bytes) -> Tensor:
    """``data`` as a uint8 tensor (a copy; empty input gives an empty tensor)."""
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())


def _as_bytes(text: str | bytes | bytearray) -> bytes:
    """Text or raw bytes as bytes; invalid UTF-8 in ``bytes`` passes unchanged."""
    if isinstance(text, str):
        # 'surrogatepass' keeps lone surrogates (from decoding with
        # 'surrogateescape') instead of raising deep inside encode.
        return text.encode("utf-8", errors="surrogatepass")
    if isinstance(text, (bytes, bytearray)):
        return bytes(text)
    raise TypeError(f"expected text as str or bytes, got {type(text).__name__}")


class ByteTokenizer:
    """Byte-level tokenizer: id = byte value, vocabulary 256, no training.

    Any input encodes, invalid UTF-8 included; :meth:`decode` replaces bytes
    that are not valid UTF-8 with U+FFFD.
    """

    vocab_size = 256

    def encode(self, text: str | bytes) -> Tensor:
        data = _as_bytes(text)
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"text of {len(data)} bytes exceeds the {MAX_TEXT_BYTES}-byte limit")
        return bytes_tensor(data).long()

    def decode(self, ids: Tensor | Iterable[int]) -> str:
        return bytes(_check_ids(ids, self.vocab_size)).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The bytes behind ``ids``: (bytes (total,), bytes per token (n,))."""
        return ids.to(torch.uint8), torch.ones_like(ids)


class BPETokenizer:
    """Byte-level BPE trained locally with the `tokenizers` library.

    Args:
        tokenizer (tokenizers.Tokenizer): a trained byte-level BPE tokenizer.
    """

    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        pieces = [self._piece_bytes(i) for i in range(self.vocab_size)]
        lengths = torch.tensor([len(p) for p in pieces], dtype=torch.long)
        self._piece_len = lengths  # (V,)
        self._piece_ptr = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])  # (V+1,)
        flat = b"".join(pieces)
        self._piece_data = bytes_tensor(flat)  # (sum of piece lengths,)

    def _piece_bytes(self, i: int) -> bytes:
        # A byte-level BPE piece decodes to text; lone bytes that are not
        # valid UTF-8 come back as U+FFFD, which is fine for rule finding.
        return self._tok.decode([i]).encode("utf-8", errors="surrogatepass")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 4096) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 257:
            raise ValueError(f"BPETokenizer: vocab_size must be at least 257 (got {vocab_size})")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def save(self, path: str | os.PathLike) -> None:
        """Write the tokenizer to one JSON file, atomically."""
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(self._tok.to_str())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer

        try:
            return cls(Tokenizer.from_file(str(path)))
        except Exception as err:  # the library raises a bare Exception
            raise ValueError(f"could not load a BPE tokenizer from {path}: {err}") from None

    def encode(self, text: str | bytes) -> Tensor:
        data = _as_bytes(text)
        if len(data) > MAX_TEXT_BYTES:
            raise ValueError(f"text of {len(data)} bytes exceeds the {MAX_TEXT_BYTES}-byte limit")
        return torch.tensor(self._tok.encode(data.decode("utf-8", errors="replace")).ids, dtype=torch.long)

    def decode(self, ids: Tensor | Iterable[int]) -> str:
        return self._tok.decode(_check_ids(ids, self.vocab_size))

    def token_bytes(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The bytes behind ``ids``: (bytes (total,), bytes per token (n,))."""
        lengths = self._piece_len[ids]  # (n,)
        starts = self._piece_ptr[ids]  # (n,)
        total = int(lengths.sum())
        token_of_byte = torch.repeat_interleave(torch.arange(ids.numel()), lengths, output_size=total)
        offset = torch.arange(total) - (lengths.cumsum(0) - lengths)[token_of_byte]
        return self._piece_data[starts[token_of_byte] + offset], lengths


def _check_ids(ids: Tensor | Iterable[int], vocab_size: int) -> list[int]:
    out = ids.tolist() if isinstance(ids, Tensor) else list(ids)
    bad = [i for i in out if not isinstance(i, int) or not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"token ids must be integers in [0, {vocab_size}) (got {bad[:3]})")
    return out
