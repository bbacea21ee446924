"""hispec: a DeepSeek-V3.2-style model served with HiSparse and MTP speculative decoding."""
