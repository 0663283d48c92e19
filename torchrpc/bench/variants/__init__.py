"""torchrpc configured otherwise, as systems of the benchmark.

Both workers of a benchmark run on one host, where torchrpc talks over a Unix socket and
shared memory. These variants make it take the path it takes between hosts, plain TCP, so
the cost of that path (and of its frame MACs) can be measured against the same baseline in
the same run. Each module is ``torchrpc.rpc`` with ``TensorPipeRpcBackendOptions`` replaced.
"""
