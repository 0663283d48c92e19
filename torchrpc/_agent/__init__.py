"""The agent layer: connections, pending requests, worker pool, shutdown (the rendezvous it
starts with is torchrpc._rendezvous)."""

from .agent import Agent
from .debug import debug_info_here
from .dispatch import run_callable
from .lanes import Expect
from .hooks import (AsyncResult, CallHook, CallScope, Described, Extensions, MessageContext, Slot,
                    describe)
from .futures import RpcFuture, error_of, fresh_error
from .pool import current_pool
from .worker import WorkerInfo

__all__ = ["Agent", "AsyncResult", "CallHook", "CallScope", "Described", "Extensions",
           "Expect", "MessageContext", "RpcFuture", "Slot", "WorkerInfo", "current_pool",
           "debug_info_here", "describe", "error_of", "fresh_error", "run_callable"]
