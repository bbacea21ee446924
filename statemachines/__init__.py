"""Pure state machines (no torch, no anyio)."""
