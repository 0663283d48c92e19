"""Settings are options, read once: every ``TORCHRPC_*`` variable is the environment's way
to set one field of the backend options; ``init_rpc`` reads them when it starts, and a bad
value (an option's or a variable's) fails naming it. No processes: nothing here starts a
group."""

from __future__ import annotations

import os

import pytest

import torchrpc.rpc as rpc
from torchrpc._agent import current
from torchrpc._rendezvous import secret
from torchrpc._rendezvous.rendezvous import Deadline, Plan, listen_host
from torchrpc._transport import reader
from torchrpc.rpc import api, options

SECRET = "s" * 40


def read(environ=None, **fields):
    """The options one init_rpc would use, with these fields, in ``environ``."""
    return options.read_environment(rpc.TensorPipeRpcBackendOptions(**fields), environ or {},
                                    environ.get(secret.SECRET_ENV) if environ else None)[0]


# field, variable, a good variable value and what it reads as, a bad value for the field
FIELDS = [
    ("listen_addr", options.LISTEN_ADDR_ENV, "10.1.2.3", "10.1.2.3", None),
    ("listen_ifname", options.IFNAME_ENV, "lo", "lo", ""),
    ("rendezvous_timeout", options.RENDEZVOUS_TIMEOUT_ENV, "7.5", 7.5, 0),
    ("spin_us", options.SPIN_US_ENV, "50", 50.0, 2e6),
    ("secret", secret.SECRET_ENV, SECRET, SECRET, 123),
    ("secret_file", options.SECRET_FILE_ENV, "/run/s", "/run/s", 5),
    ("insecure_secret_in_store", options.VIA_STORE_ENV, "1", True, "yes"),
]


@pytest.mark.parametrize("field,variable,text,value,bad", FIELDS)
def test_a_field_left_unset_is_read_from_its_variable(field, variable, text, value, bad):
    opts = rpc.TensorPipeRpcBackendOptions()
    assert getattr(opts, field) is None  # unset: the environment decides, at init_rpc
    assert getattr(read({variable: text}), field) == value


@pytest.mark.parametrize("field,variable,text,value,bad", FIELDS)
def test_an_explicit_field_wins_over_its_variable(field, variable, text, value, bad):
    explicit = {"listen_addr": "10.9.9.9", "listen_ifname": "lo", "rendezvous_timeout": 3.0,
                "spin_us": 0.0, "secret": "t" * 32, "secret_file": "/x",
                "insecure_secret_in_store": False}[field]
    assert getattr(read({variable: text}, **{field: explicit}), field) == explicit
    opts = rpc.TensorPipeRpcBackendOptions()
    setattr(opts, field, explicit)  # assignable after construction, as torch's fields
    assert getattr(opts, field) == explicit


@pytest.mark.parametrize("field,variable,text,value,bad", [f for f in FIELDS if f[4] is not None])
def test_a_bad_value_names_the_field(field, variable, text, value, bad):
    with pytest.raises((TypeError, ValueError), match=field) as info:
        rpc.TensorPipeRpcBackendOptions(**{field: bad})
    if field != "secret":
        assert repr(bad) in str(info.value)
    else:  # a secret is never shown, not even a wrong one
        assert str(bad) not in str(info.value) and "32 characters" in str(info.value)


@pytest.mark.parametrize("variable,bad", [(options.RENDEZVOUS_TIMEOUT_ENV, "soon"),
                                          (options.RENDEZVOUS_TIMEOUT_ENV, "-1"),
                                          (options.SPIN_US_ENV, "lots"),
                                          (options.SPIN_US_ENV, "-5")])
def test_a_bad_variable_names_the_variable_its_value_and_the_fix(variable, bad):
    with pytest.raises(ValueError, match=variable) as info:
        read({variable: bad})
    assert repr(bad) in str(info.value) and ("unset it" in str(info.value))


def test_the_built_in_defaults():
    got = read({})
    assert got.listen_addr is None and got.listen_ifname is None
    assert got.rendezvous_timeout == 60.0  # the RPC timeout (60 s), at least 60 s
    assert read({}, rpc_timeout=120).rendezvous_timeout == 120.0
    assert read({}, rpc_timeout=0).rendezvous_timeout == 300.0  # no RPC timeout
    assert got.spin_us is None and reader.spin_seconds(None) == (200e-6, 2000e-6)
    assert reader.spin_seconds(0.0) == (0.0, 0.0) and reader.spin_seconds(50.0) == (5e-5, 5e-5)
    assert got.secret is None and got.secret_file is None
    assert got.insecure_secret_in_store is False
    assert got.rendezvous_plan.secret == secret.Source()


def test_torchs_interface_variable_comes_after_ours():
    assert read({options.TORCH_IFNAME_ENV: "lo"}).listen_ifname == "lo"
    assert read({options.TORCH_IFNAME_ENV: "x0", options.IFNAME_ENV: "lo"}).listen_ifname == "lo"
    got = read({options.IFNAME_ENV: "lo"})
    assert got.listen_addr == "127.0.0.1" == listen_host("env://", got.listen_addr)
    # listen_addr wins over the interface
    assert read({options.IFNAME_ENV: "lo"}, listen_addr="10.0.0.1").listen_addr == "10.0.0.1"


def test_reading_copies_and_leaves_the_users_options_as_they_are():
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=5)
    got, plan = options.read_environment(opts, {options.SPIN_US_ENV: "10"})
    assert got is not opts and opts.spin_us is None and opts.rendezvous_plan is None
    assert got.spin_us == 10.0 and got.rendezvous_plan is plan
    assert options.read_environment(got, {})[0] is got  # read once: a second read keeps it
    assert got.rpc_timeout == 5 and got.num_worker_threads == opts.num_worker_threads


def test_the_secret_leaves_the_environment_once_and_never_shows(monkeypatch):
    monkeypatch.setattr(current.handle, "launcher_secret", None)
    monkeypatch.setenv(secret.SECRET_ENV, SECRET)
    got, plan = api._read_environment(rpc.TensorPipeRpcBackendOptions())
    assert secret.SECRET_ENV not in os.environ
    assert got.secret == SECRET and plan.secret.value == SECRET.encode()
    again, _ = api._read_environment(rpc.TensorPipeRpcBackendOptions())
    assert again.secret == SECRET  # a second init_rpc of this process still has it
    for shown in (repr(got), str(got), repr(plan), repr(plan.secret)):
        assert SECRET not in shown


def test_options_of_another_backend_get_the_rendezvous_timeout_only():
    base = rpc.RpcBackendOptions(rpc_timeout=2)
    got, plan = options.read_environment(base, {options.RENDEZVOUS_TIMEOUT_ENV: "9"})
    assert got is base and plan.deadline.timeout == 9.0
    assert options.read_environment(base, {})[1].deadline.timeout == 60.0


def test_a_plan_is_a_deadline_that_every_step_shares():
    plan = Plan.of(30.0)
    assert Plan.of(plan) is plan and 29.0 < plan.deadline.left() <= 30.0
    assert Plan(Deadline(-1.0)).deadline.left() == 0.001  # passed: steps fail at once
