"""Runnable example programs that re-create PyTorch's distributed RPC tutorials.

Each is run as ``python -m torchrpc.examples.<name>`` and takes ``--smoke`` for
a run of a few seconds:

* ``parameter_server``: trainers share one model on a parameter server
  (distributed autograd, DistributedOptimizer) on scikit-learn's digits.
* ``pipeline``: a ResNet-style model split over two workers, fed micro-batches.
* ``batch_rl``: one agent batching the action requests of N CartPole observers.
* ``rnn``: a character-level LSTM whose embedding and decoder are RemoteModules.
* ``ddp_rpc``: DistributedDataParallel trainers with a remote embedding table.
* ``profile_rpc``: RPCs and their remote operators in the autograd profiler.

They use only the public API (``torchrpc.rpc``, ``torchrpc.autograd``,
``torchrpc.optim``, ``torchrpc.nn``).
"""
