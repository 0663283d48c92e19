"""torchrpc configured otherwise, as systems of the benchmark.

Both workers of a benchmark run on one host, where torchrpc talks over a Unix socket and
shared memory. A variant makes it take the path it takes between hosts, plain TCP, so the
cost of that path can be measured against the same baseline in the same run. A variant
module is ``torchrpc.rpc`` with ``TensorPipeRpcBackendOptions`` replaced.
"""
