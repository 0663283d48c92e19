"""torchrpc.nn.api."""
