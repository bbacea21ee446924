"""Stateful property test of recovery from failed transfers: staging and backup copies that fail.

The rules of the HiSparse executor machine (``test_executor_machine``), over transfer streams whose
next copies can be made to fail (``arm``): as they are issued (``copy_rows`` raises) or as they land
(the copy writes nothing and its handle raises). How a handle reports a failure follows the stream it
models: a CPU stream's ``order_after`` waits and raises as ``wait`` does, a device stream's orders
the work after the copy and raises nothing (the failure shows at a later ``query`` or ``wait``), so
both of the coordinator's paths run: a backup known failed before its source is overwritten is
redone row by row; one found failed only after that loses its rows. A copy is *for* the requests
whose host slots it writes (its suspects). After every rule, besides the machine's own checks:

* a request is reported failed (by a decode step, by staging collection, by the coordinator's
  failure lists) only when a failed copy was for it, with the copy's error in the reason, and the
  failure is logged (``hisparse.backup_retried``, ``hisparse.backup_failed``,
  ``hisparse.copy_failed`` on the release of a row whose staging copy failed);
* every request no failed copy was for keeps host copies equal to the all-resident shadow's KV
  (whenever nothing is in flight), and its tokens equal the shadow's;
* ``settle``: once every copy has landed and the coordinator has waited for them, every request a
  failed copy was for is either reported failed (and is released, freeing exactly what it owned) or
  has every host copy equal to its KV (its backup redone); nothing else is reported.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import structlog
import torch
from hypothesis.stateful import initialize, precondition, rule
from shadow_model import decoded, finalized, machine_settings
from speculative.test_spec_machine import SpecMachine
from test_executor_machine import ExecutorMachine

from pipeline.hisparse.verify import FinalizeError

from manual_transfer import ManualStreams, ManualTransferStream
from shadowed_machine import ShadowedMachine


class InjectedFault(RuntimeError):
    """The error of a copy this test made fail."""


class _FaultyHandle:
    def __init__(self, stream: FaultyStream, seq: int) -> None:
        self._stream = stream
        self._seq = seq

    def _raise_if_failed(self) -> None:
        if self._seq in self._stream.failing:
            raise InjectedFault(f"copy {self._seq} of {self._stream.name} failed as it landed")

    def query(self) -> bool:
        if self._seq >= self._stream.done:
            return False
        self._raise_if_failed()
        return True

    def wait(self) -> None:
        self._stream.run_until(self._seq + 1)
        self._raise_if_failed()

    def order_after(self) -> None:
        self._stream.run_until(self._seq + 1)  # the work that follows runs here and now
        if not self._stream.device_like:  # a CPU stream waits, and so knows
            self._raise_if_failed()


class FaultyStream(ManualTransferStream):
    """A manual stream whose next copies fail when armed (``"issue"`` or ``"land"``); records the
    host slots each failed copy was to write."""

    def __init__(self, name: str, device: torch.device) -> None:
        super().__init__(name, device)
        self.armed: list[str] = []
        self.device_like = False
        self.failing: set[int] = set()  # issue numbers of the copies that fail as they land
        self.failed_slots: list[torch.Tensor] = []  # the destinations of each failed copy, unseen yet
        self.num_failed = 0  # copies made to fail

    def copy_rows(self, dst, dst_idx, src, src_idx) -> _FaultyHandle:
        if not self.armed:
            super().copy_rows(dst, dst_idx, src, src_idx)
            return _FaultyHandle(self, self.issued - 1)
        how = self.armed.pop(0)
        self.failed_slots.append(dst_idx.clone())
        self.num_failed += 1
        if how == "issue":
            raise InjectedFault(f"a copy of {self.name} could not be issued")
        nothing = dst_idx[:0]
        super().copy_rows(dst, nothing, src, nothing)  # lands without writing anything
        self.failing.add(self.issued - 1)
        return _FaultyHandle(self, self.issued - 1)


class FaultyStreams(ManualStreams):
    def __call__(self, name: str, device: torch.device) -> FaultyStream:
        stream = FaultyStream(name, device)
        self.streams[name] = stream
        return stream


class CopyFaultMachine(ExecutorMachine):
    def __init__(self) -> None:
        self.capture = structlog.testing.capture_logs()  # (left in ``teardown``)
        self.logs = self.capture.__enter__()
        super().__init__()
        self.suspects: set[str] = set()  # requests a failed copy was for

    def make_streams(self) -> ManualStreams:
        return FaultyStreams()

    @initialize(device_like=st.booleans())
    def choose_streams(self, device_like: bool) -> None:
        for stream in self.streams.streams.values():
            stream.device_like = device_like

    # --- injection ----------------------------------------------------------------------------

    @rule(
        stream=st.sampled_from(["staging", "backup"]),
        how=st.lists(st.sampled_from(["issue", "land"]), min_size=1, max_size=2),
    )
    def arm(self, stream: str, how: list[str]) -> None:
        """The next copies of ``stream`` fail (two in a row: a redone backup fails again)."""
        self.streams.streams[stream].armed = list(how)

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(how=st.lists(st.sampled_from(["issue", "land"]), min_size=1, max_size=2), steps=st.integers(1, 3))
    def a_backup_fails(self, how: list[str], steps: int) -> None:
        """Decode steps whose first backup fails (and its first redo, with two)."""
        self.arm("backup", how)
        self.decode(steps)

    def note_failed_copies(self) -> None:
        """The requests whose host slots a copy that failed since the last call was to write."""
        coord = self.executor.memory
        for stream in self.streams.streams.values():
            for slots in stream.failed_slots:
                for rid in self.phase:
                    row_slots = coord.host.req_to_host[self.executor.seqs[rid].row]
                    if bool(torch.isin(slots, row_slots[row_slots >= 0]).any()):
                        self.suspects.add(rid)
            stream.failed_slots = []

    def take_failures(self, failed: dict[str, str], what: str) -> None:
        """Requests reported failed: each one a failed copy was for, the error in its reason; then
        released (in the shadow too)."""
        self.note_failed_copies()
        for rid, why in failed.items():
            assert rid in self.suspects, f"{what}: {rid} failed, and no failed copy was for it: {why}"
            assert "copy failed" in why and "InjectedFault" in why, f"{what}: {rid}: {why}"
            row = self.executor.seqs[rid].row
            if why.startswith("backup"):  # its KV has no host copy: logged as it was found
                logged = [e for e in self.logs if e["event"] == "hisparse.backup_failed" and e["row"] == row]
                assert logged and logged[-1]["error"] == why, f"{what}: {rid}: not logged as lost"
        for rid in sorted(failed):
            staging = failed[rid].startswith("staging")
            before = len(self.logs)
            row = self.executor.seqs[rid].row
            self.end_request(rid)
            if staging:  # its release waits for the failed copy, and logs it
                logged = [e for e in self.logs[before:] if e["event"] == "hisparse.copy_failed"]
                assert [(e["row"], e["copy"]) for e in logged] == [(row, "staging")], logged
                assert "InjectedFault" in logged[0]["error"], logged

    # --- rules --------------------------------------------------------------------------------

    @rule(length=st.integers(1, 40), seed=st.integers(0, 255))
    def admit(self, length: int, seed: int) -> None:
        super().admit(length, seed)
        self.note_failed_copies()

    @rule()
    def collect(self) -> None:
        """Staged requests whose copy landed are collected in FIFO order; one whose copy failed is
        skipped and reported."""
        coord = self.executor.memory
        ready = self.executor.collect_ready()
        failed_rows = coord.take_staging_failures()
        by_row = {self.executor.seqs[rid].row: rid for rid in self.phase}
        failed = {by_row[row]: why for row, why in failed_rows.items()}
        staged = [r for r, p in self.phase.items() if p == "staging" and r not in failed]
        assert ready == staged[: len(ready)], "collect_ready must pop in FIFO order"
        for rid in ready:
            self.phase[rid] = "decode"
            self.models[rid].device = {}
        self.shadow.collect_ready(ready)
        self.take_failures(failed, "staging collection")

    @precondition(lambda self: "decode" in self.phase.values())
    @rule(steps=st.integers(1, 5))
    def decode(self, steps: int) -> None:
        for _ in range(steps):
            ids = [r for r, p in self.phase.items() if p == "decode"]
            if not ids:
                return
            result = self.executor.decode(ids)
            self.note_failed_copies()
            for rid in result.refused:  # memory pressure: the request is retracted
                self.end_request(rid)
            shadow = self.shadow.decode(list(result.tokens))
            assert shadow.tokens == result.tokens, "a failed copy changed another request's answer"
            for rid, new in result.tokens.items():
                assert len(new) == 1, (rid, new)
                decoded(self.models[rid], self.executor.memory.hot, self.columns(rid))
            self.take_failures(dict(result.failed), "a decode step")
            self.check_device_kv()
            self.check_model("after a decode step: ")

    @rule()
    def settle(self) -> None:
        """Every copy lands and the coordinator waits for them: each request a failed copy was for is
        reported failed, or has its host copies whole (its backup redone)."""
        self.all_copies_land_unchecked()
        coord = self.executor.memory
        self.executor.wait_staging()
        coord.wait_backups()
        self.note_failed_copies()
        by_row = {self.executor.seqs[rid].row: rid for rid in self.phase}
        failed = {by_row[row]: why for row, why in coord.take_staging_failures().items()}
        failed |= {by_row[row]: why for row, why in coord.take_backup_failures(sorted(by_row)).items()}
        self.take_failures(failed, "settling")
        self.suspects.clear()
        ShadowedMachine.check_host_kv(self)  # every request, no exception
        self.check_logs()

    def all_copies_land_unchecked(self) -> None:
        for stream in self.streams.streams.values():
            stream.synchronize()

    @rule()
    def all_copies_land(self) -> None:
        self.all_copies_land_unchecked()
        self.check_device_kv()
        self.check_host_kv()

    # --- checks -------------------------------------------------------------------------------

    def check_host_kv(self) -> None:
        """The machine's check, but for the requests a failed copy was for (``settle`` checks them)."""
        self.note_failed_copies()
        coord = self.executor.memory
        every = torch.arange(coord.num_layers)[:, None]
        for rid in self.phase:
            if rid in self.suspects:
                continue
            row = self.executor.seqs[rid].row
            positions = torch.arange(coord.length(row))
            host_kv = coord.host.kv[:, coord.host.req_to_host[row, positions]]
            assert torch.equal(host_kv, self._true_kv(rid, every, positions[None, :])), (
                f"{rid}: a host copy differs from the position's KV, and no failed copy was for it"
            )

    def end_request(self, rid: str) -> None:
        self.note_failed_copies()
        super().end_request(rid)
        self.suspects.discard(rid)

    def teardown(self) -> None:
        try:
            for stream in self.streams.streams.values():
                stream.armed = []
            try:
                self.settle()
            finally:  # (whatever settling found, the machine's own teardown runs: it unpatches)
                super().teardown()
            self.check_logs()
        finally:
            self.capture.__exit__(None, None, None)

    def check_logs(self) -> None:
        """Every failure logged is an injected one, with its error; once settled, every failed
        backup copy was either redone (``hisparse.backup_retried``, once for the whole copy), lost
        rows (``hisparse.backup_failed``, once a row) or found its rows failed or ended already
        (``hisparse.backup_dropped``), and nothing was redone without a failure."""
        count = {"hisparse.backup_retried": 0, "hisparse.backup_failed": 0, "hisparse.backup_dropped": 0}
        for entry in self.logs:
            if entry["event"] in (*count, "hisparse.copy_failed"):
                assert "InjectedFault" in entry["error"], entry
            if entry["event"] in count:
                count[entry["event"]] += 1
        failed = self.streams.streams["backup"].num_failed
        retried, lost, dropped = count.values()
        assert retried <= failed <= retried + lost + dropped, f"{failed} failed backup copies, logs {count}"


TestCopyFaultMachine = pytest.mark.proptest(CopyFaultMachine.TestCase)
TestCopyFaultMachine.settings = machine_settings(examples=30, steps=40)


class SpecCopyFaultMachine(CopyFaultMachine, SpecMachine):
    """The same with speculative rounds (``SpecMachine``'s draft and verify): a backup that failed
    before a verify, or a finalize's own backup that failed, fails its request in that verify (an
    earlier failure rolls its finalize back; ``take_failure`` names the row)."""

    model = SpecMachine.model
    max_prompt = SpecMachine.max_prompt
    config = SpecMachine.config
    shadow_config = SpecMachine.shadow_config

    def __init__(self) -> None:
        super().__init__()
        verify = self.executor.memory.verify
        take = verify.take_failure

        def take_failure(row: int) -> FinalizeError | None:
            error = take(row)
            assert error is not None and error.row == row, f"take_failure({row}) gave {error!r}"
            return error

        verify.take_failure = take_failure

    @precondition(lambda self: "drafted" in self.phase.values())
    @rule()
    def verify(self) -> None:
        ids = [r for r, p in self.phase.items() if p == "drafted"]
        result = self.executor.verify(ids)
        shadow = self.shadow.verify(ids)  # (the same batch: the same bits; its failed ones are released)
        self.note_failed_copies()
        hot, d = self.executor.memory.hot, self.executor.draft_tokens
        for rid in ids:
            self.phase[rid] = "decode"
            if rid in result.failed:
                continue
            assert result.tokens[rid] == shadow.tokens[rid], "a failed copy changed another request's answer"
            count = len(result.tokens[rid])
            finalized(self.models[rid], count, d, hot, self.columns(rid))
        self.take_failures(dict(result.failed), "a verify")
        self.executor.check_integrity(data=False)
        self.check_model("after finalize: ")

    @rule(how=st.lists(st.sampled_from(["issue", "land"]), min_size=1, max_size=2))
    def a_verify_backup_fails(self, how: list[str]) -> None:
        """A round whose finalize's backup fails (the draft's own copies come first)."""
        if "decode" in self.phase.values():
            self.draft()
        if "drafted" in self.phase.values():
            self.arm("backup", how)
            self.verify()

    def teardown(self) -> None:
        try:
            CopyFaultMachine.teardown(self)
        finally:
            del self.executor.memory.verify.take_failure  # (no cycle from the memory back to the test)


TestSpecCopyFaultMachine = pytest.mark.proptest(SpecCopyFaultMachine.TestCase)
TestSpecCopyFaultMachine.settings = machine_settings(examples=30, steps=40)
