"""Speculative decoding counters, named as SGLang and vLLM define them.

* accept length: tokens committed per verify, the bonus token included
  (``(accepted drafts + verify rounds) / verify rounds``);
* accept rate: accepted drafts / proposed drafts, the bonus token excluded;
* accepted count per draft position (vLLM's ``num_accepted_tokens_per_pos``);
* a histogram of accept lengths.
"""

from __future__ import annotations

import attrs


@attrs.define
class SpecCounters:
    num_steps: int
    verify_rounds: int = 0
    proposed_drafts: int = 0
    accepted_drafts: int = 0
    accepted_per_pos: list[int] = attrs.field(init=False)
    accept_length_histogram: dict[int, int] = attrs.Factory(dict)

    def __attrs_post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_steps

    def record(self, accepted: int) -> None:
        """One request's verify round with ``accepted`` of ``num_steps`` drafts taken (raises
        ``ValueError``, counters unchanged, outside ``0..num_steps``)."""
        if not 0 <= accepted <= self.num_steps:
            raise ValueError(f"accepted must lie in [0, {self.num_steps}], got {accepted}")
        self.verify_rounds += 1
        self.proposed_drafts += self.num_steps
        self.accepted_drafts += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        length = accepted + 1
        self.accept_length_histogram[length] = self.accept_length_histogram.get(length, 0) + 1

    @property
    def accept_length(self) -> float | None:
        return (
            (self.accepted_drafts + self.verify_rounds) / self.verify_rounds if self.verify_rounds else None
        )

    @property
    def accept_rate(self) -> float | None:
        return self.accepted_drafts / self.proposed_drafts if self.proposed_drafts else None

    def as_dict(self) -> dict[str, object]:
        return {
            "verify_rounds": self.verify_rounds,
            "proposed_drafts": self.proposed_drafts,
            "accepted_drafts": self.accepted_drafts,
            "accept_length": self.accept_length,
            "accept_rate": self.accept_rate,
            "accepted_per_pos": list(self.accepted_per_pos),
            "accept_length_histogram": dict(sorted(self.accept_length_histogram.items())),
        }
