"""HiSparse: per-request device buffers over a host copy of every token, with LRU swap-in."""
