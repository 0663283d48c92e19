"""Other systems for the benchmark: torchrpc configured otherwise, and a floor.

Both workers of a benchmark run on one host, where torchrpc talks over a Unix socket and
shared memory. The ``tcp`` variant makes it take the path it takes between hosts, plain
TCP, so the cost of that path can be measured against the same baseline in the same run;
it is ``torchrpc.rpc`` with ``TensorPipeRpcBackendOptions`` replaced. ``floor`` and
``floor_self`` are not torchrpc at all: a featureless RPC of the same two calls, the
least any pure-Python design costs on the machine (see ``floor.py``).

``nogc``, ``nopark`` and ``tcp_nomac`` each turn one thing off for the whole process (the
cycle collector, the parked OpenMP team, the frame MACs), to measure what it costs; they
are not built-in systems but named with ``--define-system`` (each module says how).
"""
