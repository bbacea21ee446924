"""``hispec bench spec`` plumbing: the configurations' order goes through every order of them, prompt
by prompt (what ran just before moves a run's speed); the outputs are compared (no timing asserted)."""

from __future__ import annotations

import collections
import itertools
import json

from pipeline.benchmarks import spec


def test_each_configuration_runs_right_after_each_other_equally_often(tmp_path, monkeypatch):
    order = []
    real = spec.run_batch

    def recorded(executor, batch, new_tokens):
        order.append(executor.num_steps)
        return real(executor, batch, new_tokens)

    monkeypatch.setattr(spec, "run_batch", recorded)
    out = tmp_path / "spec.json"
    argv = ["--prompts", "6", "--prompt-len", "8", "--new-tokens", "3", "--max-steps", "2", "--repeats", "1",
            "--out", str(out)]
    assert spec.main(argv) == 0
    turns = [tuple(order[i : i + 3]) for i in range(0, 18, 3)]
    assert sorted(turns) == sorted(itertools.permutations([0, 1, 2]))
    after = collections.Counter((t[i], t[i + 1]) for t in turns for i in range(2))
    assert set(after.values()) == {2} and len(after) == 6
    assert json.loads(out.read_text())["outputs_identical_to_plain"] is True
