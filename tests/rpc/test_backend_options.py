"""torch's errors for backend options, init_rpc's arguments and builtin operators (no
processes: each check runs before any rendezvous)."""

import dataclasses
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

import torchrpc.rpc as rpc
from torchrpc import _testing
from torchrpc._agent.dispatch import run_callable
from torchrpc._rendezvous.rendezvous import claim_membership, missing_rank_error
from torchrpc.rpc import backend_registry
from torchrpc.rpc.options import agent_settings


def test_options_of_the_wrong_type_are_torchs_type_errors():
    with pytest.raises(TypeError, match="incompatible constructor arguments") as info:
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=datetime.timedelta(seconds=3))
    assert "total_seconds" in str(info.value) and isinstance(info.value, ValueError)
    opts = rpc.TensorPipeRpcBackendOptions()
    with pytest.raises(TypeError, match="incompatible function arguments"):
        opts.num_worker_threads = 2.5
    with pytest.raises(ValueError, match=">= 0"):
        opts.rpc_timeout = -3


@pytest.mark.parametrize("field, value, error, message", [
    ("enable_shm", 1, TypeError, "enable_shm must be a bool, got 1"),
    ("enable_uds", "yes", TypeError, "enable_uds must be a bool, got 'yes'"),
    ("shm_threshold", -1, ValueError, "shm_threshold must be an int >= 0, got -1"),
    ("shm_threshold", 1.5, ValueError, "shm_threshold must be an int >= 0, got 1.5"),
    ("stripe_threshold", -1, ValueError, "stripe_threshold must be an int >= 0, got -1"),
    ("stripe_threshold", "4M", ValueError, "stripe_threshold must be an int >= 0, got '4M'"),
    ("listen_addr", "", ValueError, "listen_addr must be a non-empty str or None"),
    ("listen_addr", 10, ValueError, "listen_addr must be a non-empty str or None, got 10"),
])
def test_transport_fields_are_validated_when_built_and_when_set(field, value, error, message):
    with pytest.raises(error, match=message):
        rpc.TensorPipeRpcBackendOptions(**{field: value})
    opts = rpc.TensorPipeRpcBackendOptions()
    before = getattr(opts, field)
    with pytest.raises(error, match=message):
        setattr(opts, field, value)
    assert getattr(opts, field) == before


def test_the_agent_settings_are_the_options_fields_read_once():
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=3, shm_threshold=1 << 20,
                                           enable_uds=False, spin_us=5.0,
                                           stripe_threshold=0)
    opts.set_device_map("w1", {"cpu": "cpu"})
    settings = agent_settings(opts)
    assert (settings.num_worker_threads, settings.shm_threshold, settings.enable_uds,
            settings.spin_us, settings.stripe_threshold) == (3, 1 << 20, False, 5.0, 0)
    assert rpc.TensorPipeRpcBackendOptions().stripe_threshold == 4 << 20
    assert settings.device_maps == {"w1": {torch.device("cpu"): torch.device("cpu")}}
    opts.num_worker_threads = 5  # later changes to the options do not reach the settings
    assert settings.num_worker_threads == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.num_worker_threads = 5  # type: ignore[misc]


def test_tensor_mac_is_on_by_default_and_must_be_a_bool():
    opts = rpc.TensorPipeRpcBackendOptions()
    assert opts.tensor_mac is True
    assert rpc.TensorPipeRpcBackendOptions(tensor_mac=False).tensor_mac is False
    with pytest.raises(TypeError, match="tensor_mac must be a bool, got 'no'"):
        rpc.TensorPipeRpcBackendOptions(tensor_mac="no")
    with pytest.raises(TypeError, match="tensor_mac must be a bool, got 0"):
        opts.tensor_mac = 0
    assert opts.tensor_mac is True


def test_options_of_another_backend_are_refused_with_torchs_words():
    faulty_opts = _testing.FaultyTensorPipeRpcBackendOptions(num_fail_sends=1)
    with pytest.raises(TypeError, match="`rpc_backend_options` must be a "
                                        "`FaultyTensorPipeRpcBackendOptions`"):
        backend_registry.init_backend(rpc.BackendType.FAULTY_TENSORPIPE, None, "w", 0, 1,
                                      rpc.TensorPipeRpcBackendOptions())
    with pytest.raises(TypeError, match="`rpc_backend_options` must be a "
                                        "`TensorPipeRpcBackendOptions`"):
        backend_registry.init_backend(rpc.BackendType.TENSORPIPE, None, "w", 0, 1,
                                      rpc.RpcBackendOptions())
    assert isinstance(faulty_opts, rpc.TensorPipeRpcBackendOptions)


def test_faulty_backend_takes_torchs_message_names():
    opts = backend_registry.construct_rpc_backend_options(
        rpc.BackendType["FAULTY_TENSORPIPE"], num_worker_threads=8, num_fail_sends=3,
        messages_to_fail=["RREF_FORK_REQUEST", "RREF_CHILD_ACCEPT", "RREF_USER_DELETE",
                          "CLEANUP_AUTOGRAD_CONTEXT_REQ"],
        messages_to_delay={"PYTHON_CALL": 1.5, "SCRIPT_CALL": 1.5})
    assert opts.num_fail_sends == 3 and len(opts.messages_to_fail) == 4
    with pytest.raises(ValueError, match="unknown message kind"):
        _testing.FaultyTensorPipeRpcBackendOptions(messages_to_fail=["NO_SUCH_KIND"])


def test_missing_rank_names_the_rendezvous_as_torch_does():
    assert "file:// rendezvous: rank parameter missing" in str(missing_rank_error("file:///x"))
    assert "environment variable RANK expected" in str(missing_rank_error("env://"))
    env = {k: os.environ.pop(k) for k in ("RANK",) if k in os.environ}
    try:
        with pytest.raises(ValueError, match="tcp:// rendezvous: rank parameter missing"):
            rpc.init_rpc("w", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method="tcp://127.0.0.1:1"))
    finally:
        os.environ.update(env)


def test_a_store_serves_static_or_dynamic_members_not_both():
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "rdv"), -1)
        claim_membership(store, "static")
        claim_membership(store, "static")
        with pytest.raises(RuntimeError, match="RPC group mixes statically and dynamically "
                                               "initialized members which is not supported."):
            claim_membership(store, "dynamic")


def test_builtin_operator_with_arguments_of_no_schema_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="Overloaded torch operator invoked from Python "
                                           "failed to match any schema") as info:
        run_callable(torch.add, (), {})
    assert isinstance(info.value, TypeError)

    def user_function():
        raise TypeError("a user's own TypeError")

    with pytest.raises(TypeError, match="a user's own") as info:
        run_callable(user_function, (), {})
    assert not isinstance(info.value, RuntimeError)
