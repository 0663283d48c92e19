"""The agent layer: rendezvous, connections, pending requests, worker pool, shutdown."""

from .agent import (Agent, AsyncResult, CallHook, CallScope, MessageContext, describe,
                    run_callable)
from .futures import RpcFuture, fresh_error
from .pool import current_pool
from .worker import WorkerInfo

__all__ = ["Agent", "AsyncResult", "CallHook", "CallScope", "MessageContext", "RpcFuture",
           "WorkerInfo", "current_pool", "describe", "fresh_error", "run_callable"]
