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
    assert split_host(environ=env) is None
    assert env == {"XLA_FLAGS": f"{FLAG}=8", ENV: "2"}


def test_the_variable_sets_the_count_and_one_turns_it_off(no_jax):
    env = {ENV: "3"}
    assert split_host(environ=env) == 3 and env["XLA_FLAGS"] == f"{FLAG}=3"
    env = {ENV: "1"}
    assert split_host(environ=env) is None and "XLA_FLAGS" not in env


def test_devices_beyond_the_cores_are_not_made(no_jax, monkeypatch):
    """Issue 58: `translate --devices 99` on 4 cores made 99 XLA devices; now the split is the cores
    whatever --devices asks (it picks the first N), so the mesh refuses 99 as training does."""
    from train.translate import jobs
    from train.commands import translate

    class Split(Exception):
        pass

    asked = []
    monkeypatch.setattr(jobs, "split_host", lambda *a, **k: asked.append((a, k)) or (_ for _ in ()).throw(Split))
    with pytest.raises(Split):
        translate.main(["--run-dir", "run", "--devices", "99"])
    assert asked == [((), {})]  # --devices is not the count
    assert split_host(environ={}) == 4


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5", "²", "257", "2000"])
def test_a_bad_count_is_named(no_jax, value):
    with pytest.raises(ValueError, match=rf"\${ENV}='{value}': expected a number of devices from 1 to {MAX_DEVICES}$"):
        split_host(environ={ENV: value})


def test_the_count_is_bounded(no_jax, monkeypatch):
    """A machine of 1,000 cores: MAX_DEVICES devices, never a count that exhausts memory."""
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


@pytest.mark.parametrize("value", ["abc", "0", "", "-2", "2.5"])
def test_a_bad_count_in_xla_flags_is_one_line_before_jax_reads_it(value, monkeypatch, capsys):
    """Issue 58: XLA aborts on `--xla_force_host_platform_device_count=abc` printing 94 lines of its
    flags; the search CLIs (split_host, even once jax is imported) and train.run refuse it first."""
    from train import loop
    from train.commands import run as train_run

    env = {"XLA_FLAGS": f"--xla_cpu_use_thunk_runtime=true {FLAG}={value}"}
    with pytest.raises(ValueError, match=rf"^\$XLA_FLAGS: {FLAG}='{value}': expected a number of devices from 1$"):
        split_host(environ=env)
    monkeypatch.setenv("XLA_FLAGS", env["XLA_FLAGS"])
    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("training started"))
    assert train_run.main(["--backend", "torch", "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err == f"error: $XLA_FLAGS: {FLAG}='{value}': expected a number of devices from 1\n"


def test_aiayn_translate_bench_splits_the_host_before_jax_is_imported(tmp_path):
    """`aiayn translate-bench` imports its command module, whose benchmark imports jax: the split came only under
    `python -m` (its __main__ block), so through aiayn the JAX rows ran on one device."""
    import os
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = ("import train.commands; "
              f"status = train.commands.main(['translate-bench', '--run-dir', {str(tmp_path / 'none')!r}]); "
              "import jax; print(status, jax.device_count())")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, env={**env, "PYTHONPATH": str(repo), ENV: "3"},
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["1", "3"], done.stderr  # no run there (status 1), on 3 devices all the same
