"""The attention backend of a mixed forward: decode tokens and prefill chunks in one flat batch.

A mixed step (a ``Mixed`` command, ``pipeline/messages.py``; its forward built by
``pipeline/forward.py``) runs the running requests' decode tokens and one prefill forward's chunks
through the model once: the linear and MoE layers see every token together, and attention, the only
part that depends on where a token's request stands, is dispatched per segment.
The flat batch is the decode tokens first, then the chunks' tokens; each layer's
``AttentionInputs`` is cut at that boundary, the decode backend (``steps=1``) attends its rows and the
prefill backend (``chunk_starts``) its own, exactly as each would in a forward of its own, and the
two outputs are joined in the same order. The two segments never share a request, so neither reads a
row the other writes in the same layer.
"""

from __future__ import annotations

import attrs
import torch

from pipeline.model.attention_api import AttentionBackend, AttentionInputs


def _cut(inputs: AttentionInputs, part: slice) -> AttentionInputs:
    """The inputs of the tokens ``part`` (the indexer tensors stay None on a shared layer)."""
    return attrs.evolve(
        inputs,
        q_latent=inputs.q_latent[part],
        q_rope=inputs.q_rope[part],
        kv_rows=inputs.kv_rows[part],
        index_q=None if inputs.index_q is None else inputs.index_q[part],
        index_w=None if inputs.index_w is None else inputs.index_w[part],
        index_k=None if inputs.index_k is None else inputs.index_k[part],
    )


@attrs.define(eq=False)
class MixedBackend:
    """``AttentionBackend`` over ``decode`` for the first ``split`` tokens and ``prefill`` for the rest."""

    decode: AttentionBackend
    prefill: AttentionBackend
    split: int  # decode tokens at the front of the flat batch

    def attend(self, inputs: AttentionInputs) -> torch.Tensor:
        head = self.decode.attend(_cut(inputs, slice(0, self.split)))
        tail = self.prefill.attend(_cut(inputs, slice(self.split, None)))
        return torch.cat([head, tail])
