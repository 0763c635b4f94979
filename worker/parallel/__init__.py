"""Tensor parallelism: one model sharded over several worker ranks.

- ``sharding``: the decoder's linear layers cut by its transformers
  tensor-parallel plan (column / row parallel, one all-reduce per row layer).
- ``group``: the torch.distributed groups of a rank (control broadcasts,
  compute all-reduces), bounded waits, heartbeats.
- ``rank``: a rank's process: rank 0 serves the server over gRPC and fans each
  message out; the other ranks follow.
- ``launcher``: ``tensor_parallel_size=N`` on one host: start the N rank
  processes and drive rank 0 like any remote worker.
"""
