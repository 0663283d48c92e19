"""Runs PyTorch's own RPC test suites, imported from the installed torch, against torchrpc."""
