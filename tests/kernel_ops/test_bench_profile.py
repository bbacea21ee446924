"""``hispec bench profile`` plumbing: it profiles HiSparse decoding and keeps the raw profile (no
timing is asserted)."""

from __future__ import annotations

import pstats

from pipeline.cli import main


def test_profile_covers_the_hisparse_decode_path(tmp_path, capsys):
    out = tmp_path / "decode.prof"
    args = ["--batch", "2", "--prompt-len", "8", "--new-tokens", "3", "--top", "5", "--out", str(out)]
    assert main(["bench", "profile", *args]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("batch 2: ") and "output digest" in printed
    functions = {name for _, _, name in pstats.Stats(str(out)).stats}
    assert {"attend", "record_swap_in", "commit_decode"} <= functions  # the swap-in counted, either path
