"""`train.backends.host_devices.split_host`: one XLA CPU device per core for the search CLIs, set
in XLA_FLAGS before jax is imported (the CLIs' processes are tested in test_translate_stream.py)."""

from __future__ import annotations

import sys

import pytest

from train.backends import host_devices
from train.backends.host_devices import ENV, FLAG, MAX_DEVICES, split_host


@pytest.fixture
def no_jax(monkeypatch):
    """As in a CLI's process before its first jax import, with 4 cores."""
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.setattr(host_devices, "cores", lambda: 4)


def test_one_device_per_core_by_default(no_jax):
    env = {}
    assert split_host(environ=env) == 4
    assert env == {"XLA_FLAGS": f"{FLAG}=4"}


def test_other_xla_flags_are_kept(no_jax):
    env = {"XLA_FLAGS": "--xla_cpu_use_thunk_runtime=true"}
    assert split_host(environ=env) == 4
    assert env["XLA_FLAGS"] == f"--xla_cpu_use_thunk_runtime=true {FLAG}=4"


def test_a_count_in_xla_flags_is_the_users(no_jax):
    env = {"XLA_FLAGS": f"{FLAG}=8", ENV: "2"}
    assert split_host(8, environ=env) is None
    assert env == {"XLA_FLAGS": f"{FLAG}=8", ENV: "2"}


def test_the_variable_sets_the_count_and_one_turns_it_off(no_jax):
    env = {ENV: "3"}
    assert split_host(environ=env) == 3 and env["XLA_FLAGS"] == f"{FLAG}=3"
    env = {ENV: "1"}
    assert split_host(environ=env) is None and "XLA_FLAGS" not in env


def test_devices_asked_for_are_made(no_jax):
    """--devices 8 on 4 cores (or with the split turned off): 8 devices, as the user asked."""
    env = {ENV: "1"}
    assert split_host(8, environ=env) == 8 and env["XLA_FLAGS"] == f"{FLAG}=8"
    assert split_host(2, environ={}) == 4  # fewer than the cores: the cores (--devices picks the first 2)


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5", "²", "257", "2000"])
def test_a_bad_count_is_named(no_jax, value):
    with pytest.raises(ValueError, match=rf"\${ENV}='{value}': expected a number of devices from 1 to {MAX_DEVICES}$"):
        split_host(environ={ENV: value})


def test_the_count_is_bounded(no_jax, monkeypatch):
    """A machine of 1,000 cores or --devices 1000: MAX_DEVICES devices (the mesh then says --devices
    1000 cannot be met), never a count that exhausts memory."""
    assert split_host(1000, environ={}) == MAX_DEVICES
    monkeypatch.setattr(host_devices, "cores", lambda: 1000)
    assert split_host(environ={}) == MAX_DEVICES
    assert split_host(environ={ENV: str(MAX_DEVICES)}) == MAX_DEVICES


def test_too_late_once_jax_is_imported(monkeypatch):
    import jax  # noqa: F401 (imported: XLA has made its devices)

    env = {}
    assert split_host(environ=env) is None and env == {}


def test_one_core_one_device(monkeypatch):
    monkeypatch.delitem(sys.modules, "jax", raising=False)
    monkeypatch.setattr(host_devices, "cores", lambda: 1)
    env = {}
    assert split_host(environ=env) is None and env == {}
