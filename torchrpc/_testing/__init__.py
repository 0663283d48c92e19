"""Test infrastructure shipped with torchrpc: a fault-injecting backend."""
