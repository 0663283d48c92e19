"""Large tensors between workers that reach each other over TCP alone (no Unix socket,
no shared memory: as on different hosts) travel half over each connection's stripe
(``_transport/stripe.py``): blocking calls (a private connection, whose caller reads
the reply itself), futures, a burst of them, ``remote()`` and its ``to_here()``, with
values intact and the stripes' counters in the debug info. tests/transport/test_stripe.py
and test_two_namespaces.py test the stripe itself.
"""

from __future__ import annotations

import pytest
import torch

import torchrpc.rpc as rpc

from ..support.group import running_group

MiB = 1 << 20


@pytest.fixture(scope="module")
def group():
    options = {"enable_uds": False, "enable_shm": False, "stripe_threshold": 2 * MiB}
    with running_group(2, threads=4, options=options) as g:
        yield g


def _counters() -> tuple:
    info = rpc.api._get_debug_info()
    return (info["transport.stripes_opened"], info["transport.stripe_bytes_sent"],
            info["transport.stripe_bytes_received"])


def _data(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n // 4, generator=torch.Generator().manual_seed(seed))


def test_blocking_calls_and_futures_carry_large_tensors_over_the_stripes(group):
    _, sent, received = _counters()
    x, small = _data(8 * MiB, 1), _data(MiB, 2)
    back = rpc.rpc_sync("worker1", torch.add, args=(x, 1.0))
    assert torch.equal(back, x + 1.0)
    assert torch.equal(rpc.rpc_sync("worker1", torch.neg, args=(small,)), -small)
    futures = [rpc.rpc_async("worker1", torch.mul, args=(_data(6 * MiB, s), 2.0))
               for s in range(6)]
    for s, fut in enumerate(futures):
        assert torch.equal(fut.wait(), _data(6 * MiB, s) * 2.0)
    opened, sent_after, received_after = _counters()
    # Half of each large message, at least, went over a stripe each way; the small
    # one (below the threshold) over its connection alone.
    least = 8 * MiB // 2 + 6 * (6 * MiB // 2)
    assert opened >= 1
    assert sent_after - sent >= least and received_after - received >= least


def test_remote_and_to_here_carry_large_tensors_over_the_stripes(group):
    _, sent, received = _counters()
    x = _data(12 * MiB, 3)
    rref = rpc.remote("worker1", torch.sub, args=(x, 0.5))
    assert torch.equal(rref.to_here(), x - 0.5)
    _, sent_after, received_after = _counters()
    assert sent_after - sent >= 6 * MiB and received_after - received >= 6 * MiB
    remote_opened, _, _ = rpc.rpc_sync("worker1", _counters)
    assert remote_opened >= 1
