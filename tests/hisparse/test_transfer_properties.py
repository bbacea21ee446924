"""Property of the CPU transfer stream (``ThreadTransferStream``): any sequence of copies, small and
large, lands in issue order with the rows of a plain indexed assignment, and a copy runs at once in
the caller when it is at most ``inline_bytes`` (all layers) and nothing is in flight, and never when
it is larger (an empty copy has nothing to do)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from pipeline.hisparse.transfer import DoneHandle, ThreadTransferStream

ROWS = 12
copies = st.lists(
    st.tuples(
        st.lists(st.integers(0, ROWS - 1), min_size=0, max_size=6, unique=True),  # destination rows
        st.integers(0, ROWS - 1),  # the first source row (consecutive sources)
    ),
    min_size=1,
    max_size=6,
)


@pytest.mark.proptest
@settings(max_examples=25, deadline=None)
@given(
    copies=copies,
    layers=st.integers(1, 3),
    dim=st.integers(1, 5),
    inline_rows=st.integers(0, 8),
)
def test_copies_land_in_order_and_only_small_ones_inline(copies, layers, dim, inline_rows):
    row_bytes = layers * dim * 8  # float64, every layer
    stream = ThreadTransferStream("t", inline_bytes=inline_rows * row_bytes)
    src = torch.randn(layers, ROWS, dim, dtype=torch.float64)
    dst = torch.zeros(layers, ROWS, dim, dtype=torch.float64)
    want = dst.clone()
    handles = []
    try:
        for rows, first in copies:
            dst_idx = torch.tensor(rows, dtype=torch.int64)
            src_idx = (torch.arange(len(rows), dtype=torch.int64) + first) % ROWS
            idle = all(h.query() for h in handles)  # (never blocks; once landed, a copy stays so)
            handle = stream.copy_rows(dst, dst_idx, src, src_idx)
            if len(rows) > inline_rows:
                assert not isinstance(handle, DoneHandle), f"{len(rows)} rows ran inline"
            elif idle:  # (not idle: the worker may or may not have finished by the call)
                assert isinstance(handle, DoneHandle), f"{len(rows)} rows did not run inline"
            want[:, dst_idx] = src[:, src_idx]
            handles.append(handle)
        for handle in handles:
            handle.wait()
        assert torch.equal(dst, want), "a copy landed out of order or wrote the wrong rows"
    finally:
        stream.close()
