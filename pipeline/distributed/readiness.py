"""The ready set agreed by every rank before a step uses it.

Each rank's prompt copies to host land at their own time, so a copy may have landed on one rank and
not yet on another: with a host pool of its own, each rank's copy; with the node's shared pool
(``shared_pool.py``), the leader's copy, which a follower sees landed only once the leader's
publishing thread has seen it complete. A request that leaves staging on some ranks only would join
the next decode step there and not elsewhere: the ranks' batches, and so their collectives, would
differ and hang. So every rank's memory is wrapped in :class:`AgreedReadiness`, whose
``collect_ready`` does what SGLang's HiSparse does under tensor parallelism:

1. find, without changing anything, the rows whose copy has landed here, in staging FIFO order and
   stopping at the first still in flight (what ``collect_ready`` would take);
2. take the element-wise MIN of that 0/1 mask over every rank (one all-reduce of the candidate rows);
3. collect exactly the rows every rank has.

Every rank runs the same ``CollectReady`` commands in the same order, so the candidate rows and the
number of all-reduces agree. A copy that failed counts as settled (it is collected, i.e. reported
failed, on the rank where it failed; the distributed executor fails that request on every rank).
"""

from __future__ import annotations

import torch

from pipeline.distributed.group import TensorGroup


class AgreedReadiness:
    """A ``KVMemory`` whose ``collect_ready`` takes only what every rank has staged; everything
    else is the wrapped memory's. ``held_back`` counts rows landed here but not yet everywhere."""

    def __init__(self, memory, group: TensorGroup) -> None:
        self._memory = memory
        self._group = group
        self.held_back = 0  # rows this rank had landed but waited for another rank to land
        self.agreements = 0  # collect_ready calls that agreed over the group

    def __getattr__(self, name: str):
        return getattr(self._memory, name)

    def collect_ready(self, rows: list[int] | None = None, *, speculative: bool = False) -> list[int]:
        landed_query = getattr(self._memory, "staging_landed", None)
        if landed_query is None:  # no copies (resident memory): ready at once on every rank alike
            return self._memory.collect_ready(rows, speculative=speculative)
        candidates = self._memory.staging_rows() if rows is None else list(rows)
        if not candidates:
            return self._memory.collect_ready([], speculative=speculative)
        mask = torch.zeros(len(candidates), dtype=torch.int64)
        position = {row: i for i, row in enumerate(candidates)}
        for row in self._memory.staging_rows():  # FIFO, as collect_ready walks it
            if row not in position:
                continue
            try:
                landed = landed_query(row)
            except Exception:  # a failed copy is settled: collect_ready reports it
                landed = True
            if not landed:
                break
            mask[position[row]] = 1
        local = int(mask.sum())
        self._group.all_reduce(mask, op="min")
        self.agreements += 1
        agreed = [row for row, ok in zip(candidates, mask.tolist()) if ok]
        self.held_back += local - len(agreed)
        return self._memory.collect_ready(agreed, speculative=speculative)

    def figures(self) -> dict[str, int]:
        return {"held_back": self.held_back, "agreements": self.agreements}
