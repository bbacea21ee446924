"""Tensor parallelism over ``torch.distributed``: one engine, one executor per rank (see ``executor.py``)."""
