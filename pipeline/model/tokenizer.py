"""Byte-level tokenizer: ids 0..255 are the bytes, 256 is ``<eos>``.

Decoding never raises: invalid UTF-8 becomes U+FFFD. :class:`StreamDecoder` decodes a token stream
piece by piece and holds back an incomplete multi-byte character until its last byte arrives (or the
stream ends, when the dangling bytes become one U+FFFD).

``write_hf_files`` writes an equivalent ``tokenizer.json`` / ``tokenizer_config.json`` so the model
directory also loads as an HF ``PreTrainedTokenizerFast`` (a BPE with no merges over the 256
byte-level symbols, ids equal to byte values).
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import attrs

EOS_TEXT = "<eos>"


@attrs.frozen
class ByteTokenizer:
    eos_token_id: int = 256

    @property
    def vocab_size(self) -> int:
        return self.eos_token_id + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Bytes to text; ids outside 0..255 (``<eos>``) are dropped, bad UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def stream(self) -> StreamDecoder:
        return StreamDecoder()

    def write_hf_files(self, path: str | Path) -> None:
        out = Path(path)
        vocab = {symbol: byte for byte, symbol in _byte_symbols().items()}
        tokenizer = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": self.eos_token_id,
                    "content": EOS_TEXT,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
            ],
            "normalizer": None,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False},
            "post_processor": None,
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                        "use_regex": False},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": []},
        }
        # split_special_tokens: the text "<eos>" is five bytes, as here, not the special token
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TEXT, "split_special_tokens": True,
                  "model_max_length": 1 << 30, "clean_up_tokenization_spaces": False}
        (out / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False) + "\n")
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


class StreamDecoder:
    """Incremental decoding for streamed output."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: list[int]) -> str:
        """Text completed by these ids; a partial character waits for its next bytes."""
        return self._decoder.decode(bytes(i for i in ids if 0 <= i < 256))

    def finish(self) -> str:
        """Flush at the end of the stream: dangling bytes of a cut character become U+FFFD."""
        return self._decoder.decode(b"", final=True)


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte -> printable symbol table (what the ``ByteLevel`` pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
