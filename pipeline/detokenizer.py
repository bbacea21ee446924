"""Incremental detokenization: the text of a growing token stream, one settled delta at a time.

Decoding the whole output at every step costs O(n) per token; decoding a token alone is wrong for
most tokenizers (a byte-level BPE splits characters across tokens, byte-fallback pieces combine,
SentencePiece-style decoders treat the first token of a text differently). As vLLM's and HF's
incremental detokenizers do, :class:`IncrementalDetokenizer` decodes a short sliding window: the
tokens since the previous emission (``read``) after a few tokens of context (``prefix``), and emits
only what the window adds beyond the context's own text::

    ids      ... | prefix ........ | read ......... |
                   prefix_offset   read_offset     len(ids)
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

Both decodes start at the same token, so whatever the decoder does to the start of a text it does
to both and the difference is the new text. A delta is emitted only when it is settled:

* the window's text does not end in U+FFFD (a character cut between tokens waits for its last byte);
* the last token is not a byte-fallback piece (``<0xE2>``: a run of them decodes as a whole, and a
  run cut short turns *every* piece of it into U+FFFD, so none of it is final until the run ends;
  special tokens, which decoding leaves out, do not end a run);
* the window's text extends the context's text (otherwise nothing is emitted and the window grows).

The context is never left without text (a decoder that strips the leading space of a text could
then strip one that belongs to the next delta). ``finish()`` flushes what is held back: the
concatenation of the deltas is then ``decode(all ids)``. ``finish`` checks that (one full decode per
stream); a tokenizer whose decoder broke the window rule would be logged as ``detokenizer.mismatch``.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog

from pipeline.model.tokenizer import Tokenizer

log = structlog.get_logger("hispec.detokenizer")

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed ids with :meth:`push`, get the newly settled text; :meth:`finish` flushes the rest."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_pieces = tokenizer.byte_piece_ids
        self._special = tokenizer.special_ids
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.finished = False

    def push(self, ids: Iterable[int]) -> str:
        """Append ``ids``; returns the text they settle (possibly empty)."""
        self.ids.extend(ids)
        if self._in_byte_run():
            return ""
        window = self.tokenizer.decode(self.ids[self._prefix_offset :])
        if window.endswith(REPLACEMENT) or len(window) <= len(self._prefix_text):
            return ""
        if not window.startswith(self._prefix_text):
            return ""  # the new tokens rewrote the context's text: wait (finish() re-checks it all)
        delta = window[len(self._prefix_text) :]
        self._advance(window)
        self.text += delta
        return delta

    def _in_byte_run(self) -> bool:
        """Whether the stream may still be inside a run of byte pieces: its last id that decodes
        (special ids are left out, so they do not end a run) is a byte piece, or there is none."""
        last = next((i for i in reversed(self.ids) if i not in self._special), None)
        return last is None or last in self._byte_pieces

    def _advance(self, window: str) -> None:
        context = self.tokenizer.decode(self.ids[self._read_offset :])
        if context:
            self._prefix_offset, self._prefix_text = self._read_offset, context
        else:
            self._prefix_text = window  # keep the older context: a context must have text
        self._read_offset = len(self.ids)

    def pending(self) -> str:
        """The text the held-back ids would add if the stream ended now (not emitted; a stop string
        that completes in it ends the request, and ``finish`` then emits this same text)."""
        if self._read_offset == len(self.ids):
            return ""
        window = self.tokenizer.decode(self.ids[self._prefix_offset :])
        return window[len(self._prefix_text) :] if window.startswith(self._prefix_text) else ""

    def finish(self) -> str:
        """The end of the stream: the text still held back (a cut character becomes U+FFFD)."""
        if self.finished:
            return ""
        self.finished = True
        full = self.tokenizer.decode(self.ids)
        if not full.startswith(self.text):  # the final text is still the full decode
            log.warning("detokenizer.mismatch", streamed=self.text[-40:], decoded=full[-40:])
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text = full
        return delta
