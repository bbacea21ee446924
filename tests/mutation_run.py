"""Mutation testing of the memory logic, killed by the property tests alone (`make mutation`).

A benchmark, not a test: ``python tests/mutation_run.py run`` generates mutmut's mutants of the
files ``[tool.mutmut]`` in pyproject.toml names, then runs the sampled ones (``--every N``: the
mutants whose name hashes to 0 modulo N; 1 runs them all) against the state machines of their
file's group (``GROUPS``), one worker; ``report`` prints the score and the survivors
(docs/mutation.md says how to read both).

Which tests run a mutant: mutmut records which tests call each function; a mutant then runs those of
its file's group's machines, or, when none of them calls the function, the cheapest machine that
does. A mutant that no property test reaches is a survivor without a run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from collections import Counter, defaultdict
from pathlib import Path

# module prefix -> the tests that exercise it (the first prefix that matches a module applies); a
# test is named by its file, or by its file and class (``file::Class``) to keep one machine of a file
GROUPS: list[tuple[str, list[str]]] = [
    ("pipeline.memory.prefix_cache", ["tests/memory/test_prefix_cache_machine.py"]),
    (
        "pipeline.memory.paged",
        [
            "tests/memory/test_memory_machine.py",
            "tests/memory/test_resident_properties.py",
            "tests/hisparse/test_chunked_machine.py",  # the prefix cache sharing pages, mirrors distinct
        ],
    ),
    ("pipeline.memory.", ["tests/memory/test_memory_machine.py", "tests/memory/test_resident_properties.py"]),
    (
        "pipeline.hisparse.verify",
        [
            "tests/speculative/test_spec_machine.py",
            "tests/hisparse/test_residency_machine.py::TestSpecResidencyMachine",  # FULL rows verify
            "tests/hisparse/test_copy_fault_machine.py::TestSpecCopyFaultMachine",  # failed finalizes
        ],
    ),
    (
        "pipeline.hisparse.prefill_swap",
        ["tests/hisparse/test_prefill_groups.py", "tests/hisparse/test_executor_machine.py"],
    ),
    (
        "pipeline.hisparse.",
        [
            "tests/hisparse/test_executor_machine.py",
            "tests/hisparse/test_residency_machine.py",
            "tests/hisparse/test_chunked_machine.py",  # the only one with the prefix cache
            "tests/hisparse/test_copy_fault_machine.py",  # failed copies
            "tests/hisparse/test_machine_variants.py",  # near positions, tight pools, demotion order
            "tests/hisparse/test_transfer_properties.py",  # the CPU transfer stream
            "tests/hisparse/test_unrecoverable_miss.py",  # a position with no copy, reported
            "tests/hisparse/test_prefix_reuse.py",  # a cached prefix shared at admission
        ],
    ),
    (
        "pipeline.speculative.",
        [
            "tests/speculative/test_acceptance_properties.py",
            "tests/speculative/test_adjusted_acceptance.py",
            "tests/speculative/test_spec_machine.py",
        ],
    ),
]

# mutants that behave exactly as the original (no test can kill them): name -> why
# (docs/mutation.md, "Equivalent mutants")
EQUIVALENT: dict[str, str] = {
    "pipeline.hisparse.coordinator.xǁHiSparseCoordinatorǁ_leave_to_cache__mutmut_16": (
        "`<` to `<=`: when the lengths are equal, cutting `logical` to `len(host)` keeps it whole"
    ),
    "pipeline.hisparse.coordinator.xǁHiSparseCoordinatorǁ_load_identity__mutmut_10": (
        "`validate=False` to `validate=None`: `copy_rows` only tests `not validate`"
    ),
    "pipeline.memory.paged.xǁTableMirrorǁwrite_many__mutmut_4": (
        "`positions.to(self.device)` to `positions.to(None)`: indices on another device than the "
        "tensor they index are moved by torch; `Tensor.to(None)` returns the tensor itself"
    ),
    "pipeline.hisparse.backend.xǁHiSparseBackendǁattend__mutmut_58": (
        "`check=False` dropped: the indexer then checks the shapes, dtypes and devices of arguments "
        "the backend built itself, which pass; the result is the same"
    ),
    "pipeline.memory.paged.xǁPagedTableǁcheck_integrity__mutmut_15": (
        "in an assertion's message, evaluated only when the invariant is already broken"
    ),
    "pipeline.hisparse.coordinator.xǁHiSparseCoordinatorǁcheck_integrity__mutmut_5": (
        "a table's name, used only in the message of the assertion that compares its mirror"
    ),
    "pipeline.hisparse.prefill_swap.x_prefill_swap_rounds__mutmut_120": (
        "the guard `an earlier prompt position has no host copy` never fires: every committed "
        "position has a host copy (I6, checked by the machines after every rule)"
    ),
    "pipeline.hisparse.backend.xǁHiSparseBackendǁ_compiled_fits__mutmut_11": (
        "`steps <= MATMUL_MIN_QUERIES` to `<`: picks the torch path instead of the compiled one at "
        "exactly that many steps; the two give bit-identical results (test_compiled_attention)"
    ),
    "pipeline.hisparse.backend.xǁHiSparseBackendǁ_compiled_fits__mutmut_13": (
        "`and` to `or`: the compiled path is never taken, the torch path always; the two give "
        "bit-identical results (test_compiled_attention), so only the speed changes"
    ),
    "pipeline.hisparse.verify.xǁVerifyBuffersǁ_finalize_full__mutmut_37": (
        "the written slots replaced by None: `commit_runs` reads them for HOT rows only, and "
        "`_finalize_full` hands it FULL rows only (their slots come from their pages)"
    ),
    "pipeline.hisparse.verify.xǁVerifyBuffersǁ_reserve__mutmut_13": (
        "the failure of a host reservation at finalize: `prepare` took the host pages of all D "
        "verify tokens (`ensure_capacity`), so the reservation takes nothing and cannot fail"
    ),
    "pipeline.hisparse.coordinator.xǁHiSparseCoordinatorǁadmit__mutmut_27": (
        "the figure in the error of a demotion that does not make room: `_admission` admits a HOT "
        "prompt only when `can_free` counts enough pages, and `relieve` makes those demotions"
    ),
    "pipeline.hisparse.residency.xǁDynamicResidencyǁ_build_table__mutmut_6": (
        "`default=1` dropped from `max`: the page table is built only for a forward with FULL rows "
        "(`full_flags` finds none without them), so the rows are never empty"
    ),
}

KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def in_sample(name: str, every: int) -> bool:
    return int(hashlib.sha256(name.encode()).hexdigest(), 16) % every == 0


def group_tests(function: str) -> list[str]:
    for prefix, files in GROUPS:
        if function.startswith(prefix):
            return files
    return []


def restrict(tests_by_function: dict[str, set[str]], duration_by_test: dict[str, float]) -> None:
    """Each function keeps the tests of its group that call it, else the cheapest test that does."""
    for function, tests in tests_by_function.items():
        if not tests:
            continue
        names = group_tests(function)
        kept = {t for t in tests if any(t == n or t.startswith(f"{n}::") for n in names)}
        if not kept:
            kept = {min(tests, key=lambda t: (duration_by_test.get(t, 0.0), t))}
        tests_by_function[function] = kept


def run(every: int, fresh: bool, again: bool) -> None:
    """Generate the mutants (``fresh``: from scratch) and run the sample. ``again``: run the
    sampled mutants the last run did not kill (or did not reach, when it was stopped early) once
    more, with the tests as they are now (the mutants and their results are kept; which tests call
    what is recorded afresh)."""
    if fresh:
        shutil.rmtree("mutants", ignore_errors=True)
    os.environ["HYPOTHESIS_PROFILE"] = "mutation"  # (tests/conftest.py: the ci runs, no shrinking)
    import mutmut.__main__ as mm
    from mutmut.state import state

    names: list[str] = []
    if again:
        status, every = _results()
        # (a timeout too: a busy machine may have starved the run, not the mutant hung it)
        names = sorted(
            n
            for n, s in status.items()
            if in_sample(n, every) and n not in EQUIVALENT and (s not in KILLED or s == "timeout")
        )
        if not names:
            print("every sampled mutant of the last run was killed: nothing to run again")
            return
        Path("mutants/mutmut-stats.json").unlink(missing_ok=True)
    load = mm.collect_or_load_stats

    def load_and_restrict(runner, **kwargs):
        load(runner, **kwargs)
        restrict(state().tests_by_mangled_function_name, state().duration_by_test)

    pick = mm.collect_source_file_mutation_data

    def sampled(*, mutant_names):
        # the sample, and every mutant no test reaches (free: mutmut marks it without a run)
        mutants, by_path = pick(mutant_names=mutant_names)
        tests = state().tests_by_mangled_function_name
        keep = [
            (m, name, result)
            for m, name, result in mutants
            if in_sample(name, every) or not tests.get(name.partition("__mutmut_")[0])
        ]
        return keep, by_path

    mm.collect_or_load_stats = load_and_restrict
    mm.collect_source_file_mutation_data = sampled
    Path("mutants").mkdir(exist_ok=True)
    Path("mutants/sample.json").write_text(json.dumps({"every": every}))
    mm.cli(["run", "--max-children", "1", *names], standalone_mode=False)


NOT_RUN = "not run"  # a mutant the last run did not reach (it was stopped early)


def _results() -> tuple[dict[str, str], int]:
    """Every mutant and its status (``NOT_RUN`` without a result); the sample's ``every``."""
    from mutmut.stats import status_by_exit_code

    every = json.loads(Path("mutants/sample.json").read_text())["every"]
    status: dict[str, str] = {}
    for meta in Path("mutants").rglob("*.py.meta"):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            status[name] = NOT_RUN if code is None else status_by_exit_code[code]
    return status, every


def _unreached() -> int:
    """Mutants (of the whole scope) of the functions no property test calls, by the last record of
    which tests call what."""
    tests = json.loads(Path("mutants/mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    return sum(
        1
        for meta in Path("mutants").rglob("*.py.meta")
        for name in json.loads(meta.read_text())["exit_code_by_key"]
        if not tests.get(name.partition("__mutmut_")[0])
    )


def _diff(name: str) -> str:
    """A mutant's changed lines (from mutmut's diff of it against the original function)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    lines = get_diff_for_mutant(name).splitlines()
    changed = [line[1:].strip() for line in lines if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return " | ".join(changed)


def report(show_diffs: bool) -> None:
    """The score over the sample (equivalent mutants left out), then the sample's survivors by
    function, and how many mutants of the whole scope no property test reaches."""
    status, every = _results()
    sample = {n: s for n, s in status.items() if in_sample(n, every)}
    unreached = _unreached()
    scored = {n: s for n, s in sample.items() if n not in EQUIVALENT and s != NOT_RUN}
    killed = sum(1 for s in scored.values() if s in KILLED)
    print(f"sample: the mutants whose name hashes to 0 modulo {every}: {len(sample)}")
    for s, c in Counter(sample.values()).most_common():
        print(f"  {s}: {c}")
    print(f"  equivalent (left out): {sum(1 for n in sample if n in EQUIVALENT)}")
    if NOT_RUN in sample.values():
        print(f"  ({NOT_RUN}: left out of the score; `run --again` runs them)")
    if scored:
        print(
            f"score: {killed}/{len(scored)} = {100 * killed / len(scored):.1f}% of the non-equivalent mutants"
        )
    reached = {n: s for n, s in scored.items() if s != "no tests"}
    if reached:
        hit = sum(1 for s in reached.values() if s in KILLED)
        print(
            f"score over the mutants a property test reaches: {hit}/{len(reached)} = "
            f"{100 * hit / len(reached):.1f}%"
        )
    print(f"whole scope: {unreached} mutants that no property test reaches (every one, not a sample)")
    survivors = defaultdict(list)
    for name, s in sorted(scored.items()):
        if s not in KILLED:
            survivors[(s, name.partition("__mutmut_")[0])].append(name)
    print("the sample's survivors (status, function: count):")
    for (s, function), names in sorted(survivors.items()):
        print(f"  {s:10} {function}: {len(names)}")
        if show_diffs:
            for n in names:
                print(f"      {n}: {_diff(n)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="generate the mutants and run the sample")
    r.add_argument("--every", type=int, default=1, help="run the mutants whose name hash is 0 modulo N")
    r.add_argument("--keep", action="store_true", help="reuse mutants/ (results already there stand)")
    r.add_argument("--again", action="store_true", help="rerun the sampled mutants not killed last time")
    p = sub.add_parser("report", help="the score and the survivors of the last run")
    p.add_argument("--diffs", action="store_true", help="each surviving mutant's changed lines")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.every, fresh=not (args.keep or args.again), again=args.again)
    else:
        report(args.diffs)


if __name__ == "__main__":
    main()
