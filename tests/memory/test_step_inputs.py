"""``pipeline.memory.step_inputs.to_device``: a step's small host values for the device, each column
its own tensor with its values (on CUDA one pinned block and one asynchronous copy: the cuda tests
check that it waits for nothing)."""

from __future__ import annotations

import torch

from pipeline.memory.step_inputs import pins_for, to_device


def test_columns_keep_their_values_dtype_and_lengths():
    rows, positions, empty, table = to_device(
        torch.device("cpu"), [3, 1], [17, 40], [], torch.tensor([5, 6, 7], dtype=torch.int32)
    )
    assert rows.tolist() == [3, 1] and positions.tolist() == [17, 40] and empty.numel() == 0
    assert table.tolist() == [5, 6, 7] and {t.dtype for t in (rows, positions, empty, table)} == {torch.int64}
    (narrow,) = to_device(torch.device("cpu"), [1, 2], dtype=torch.int32)
    assert narrow.dtype == torch.int32 and narrow.tolist() == [1, 2]
    assert not pins_for(torch.device("cpu")) and pins_for(torch.device("cuda"))
