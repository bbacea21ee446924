"""The request state diagram (Mermaid), generated from the transition table.

``python -m statemachines.diagram --write`` regenerates ``docs/state-diagram.md``; a test fails when
the file no longer matches the table.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from statemachines.request import EVENTS_BY_NAME, TERMINAL, TRANSITIONS, State

DOC_PATH = Path(__file__).resolve().parent.parent / "docs" / "state-diagram.md"

# Abort and failure are legal from every live state; drawing each edge would bury the diagram, so
# they are drawn once from a composite note.
_EVERYWHERE = ("AbortRequested", "Crashed")


def mermaid() -> str:
    """The state diagram as a Mermaid ``stateDiagram-v2`` block body."""
    edges: dict[tuple[State, State], list[str]] = defaultdict(list)
    everywhere: dict[str, set[State]] = defaultdict(set)
    for (state, event), target in TRANSITIONS.items():
        if event.__name__ in _EVERYWHERE:
            everywhere[event.__name__].add(state)
            continue
        edges[(state, target)].append(event.__name__)
    lines = ["stateDiagram-v2", "    [*] --> QUEUED"]
    for (src, dst), names in sorted(edges.items(), key=lambda kv: (_order(kv[0][0]), _order(kv[0][1]))):
        lines.append(f"    {src.name} --> {dst.name}: {' / '.join(sorted(names))}")
    live = [s for s in State if s not in TERMINAL]
    for name in _EVERYWHERE:
        sources = everywhere[name]
        missing = [s.name for s in live if s not in sources]
        target = TRANSITIONS[(next(iter(sources)), EVENTS_BY_NAME[name])]
        scope = "every live state" if not missing else f"every live state except {', '.join(missing)}"
        lines.append(f"    note right of {target.name}: {name} from {scope}")
    for state in sorted(TERMINAL, key=_order):
        lines.append(f"    {state.name} --> [*]")
    return "\n".join(lines) + "\n"


def _order(state: State) -> int:
    return list(State).index(state)


def document() -> str:
    """The whole generated markdown file."""
    return (
        "# Request state diagram\n\n"
        "Generated from `statemachines/request.py` by `python -m statemachines.diagram --write`;\n"
        "do not edit by hand (a test fails when it is stale).\n\n"
        "```mermaid\n" + mermaid() + "```\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {DOC_PATH.name} instead of printing")
    args = parser.parse_args(argv)
    if args.write:
        DOC_PATH.write_text(document())
    else:
        print(document(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
