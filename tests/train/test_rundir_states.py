"""A stateful property test of run-directory operations (issue 42, item 7).

Hypothesis draws sequences of train, resume, average, convert (to JAX), export (CTranslate2),
--overwrite, deleting a checkpoint, corrupting a file and replacing a file by a symbolic link, on
a few directories under one root, and checks them against a model of what must survive: the
'victim' files links point to and a directory of the user's own are never changed; a source is
never changed by what is derived from it; a refused or failed derivation leaves its destination
as it was; every operation succeeds or ends in one `error:` line. Runs are 1+1-layer torch runs
of a step or two (each operation costs about a second); six sequences of ten operations.
"""

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from parity.commands import convert
from train import runtime
from train.commands import average
from train.commands import run as train_run

TINY = ["--backend", "torch", "--numbers-train", "300", "--numbers-valid", "4", "--numbers-test", "0",
        "--max-len", "16", "--token-budget", "512", "--set", "num_encoder_layers=1", "--set", "num_decoder_layers=1",
        "--no-progress", "--samples", "0", "--eval-sentences", "4", "--beam", "1", "--threads", "1"]
NAMES = st.sampled_from(["a", "b", "mine"])  # two places for runs and outputs, and the user's own directory


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (links followed) but the writer lock, with its bytes."""
    if not directory.is_dir():
        return {}
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != runtime.LOCK_FILE}


def machine(base_run: Path, capfd):
    class RunDirectories(RuleBasedStateMachine):
        @initialize()
        def start(self):
            self.root = Path(tempfile.mkdtemp(prefix="aiayn-states-"))
            shutil.copytree(base_run, self.root / "a")
            (self.root / "mine").mkdir()
            (self.root / "mine" / "notes.txt").write_text("the user's own")
            (self.root / "victims").mkdir()
            self.protected = {self.root / "mine" / "notes.txt": b"the user's own"}

        def teardown(self):
            shutil.rmtree(self.root, ignore_errors=True)

        def call(self, main, argv) -> int:
            """`main(argv)`'s exit status; a failure is one `error:` line, nothing else on stderr."""
            capfd.readouterr()
            try:
                code = main([str(a) for a in argv])
            except SystemExit as exited:
                code = exited.code
            err = capfd.readouterr().err
            lines = [line for line in err.splitlines() if line.strip()]
            assert "Traceback" not in err, err
            assert code == 0 or (code in (1, 2) and len(lines) == 1 and lines[0].startswith("error: ")), (code, err)
            return code

        def derive(self, main, argv, src: str, dst: str, kind: str) -> None:
            """A derivation of `dst` from `src`: the source unchanged; `dst` of `kind` when it
            worked, as it was when it did not."""
            source, target = snapshot(self.root / src), snapshot(self.root / dst)
            code = self.call(main, argv)
            assert snapshot(self.root / src) == source
            if code == 0:
                assert runtime.kind_of(self.root / dst) == kind
            else:
                assert snapshot(self.root / dst) == target

        @rule(name=NAMES, overwrite=st.booleans())
        def train(self, name, overwrite):
            self.call(train_run.main, ["--run-dir", self.root / name, "--steps", "1", "--keep-checkpoints", "1",
                                       *(["--overwrite"] if overwrite else []), *TINY])

        @rule(name=NAMES)
        def resume(self, name):
            steps = [int(p.name) for p in (self.root / name / "checkpoints").glob("[0-9]*")]
            self.call(train_run.main, ["--run-dir", self.root / name, "--resume", "--steps", max(steps, default=0) + 1,
                                       "--save-every", "1", "--keep-checkpoints", "1", "--no-progress"])

        @rule(src=NAMES, dst=NAMES, overwrite=st.booleans())
        def average(self, src, dst, overwrite):
            argv = ["--run-dir", self.root / src, "--last", "1", "--dst", self.root / dst]
            self.derive(average.main, argv + (["--overwrite"] if overwrite else []), src, dst, "run")

        @rule(src=NAMES, dst=NAMES, overwrite=st.booleans())
        def convert(self, src, dst, overwrite):
            argv = ["--to", "jax", "--run-dir", self.root / src, "--dst", self.root / dst]
            self.derive(convert.main, argv + (["--overwrite"] if overwrite else []), src, dst, "run")

        @rule(src=NAMES, dst=NAMES, overwrite=st.booleans())
        def export(self, src, dst, overwrite):
            argv = ["--to", "ctranslate2", "--src", self.root / src, "--dst", self.root / dst]
            self.derive(convert.main, argv + (["--overwrite"] if overwrite else []), src, dst, "ctranslate2")

        def regular_files(self, name: str, under: str = "") -> list[Path]:
            return sorted(p for p in (self.root / name / under).rglob("*") if p.is_file() and not p.is_symlink()
                          and p.name != runtime.LOCK_FILE)

        @rule(name=NAMES, data=st.data())
        def delete_a_step(self, name, data):
            steps = sorted((self.root / name / "checkpoints").glob("[0-9]*"))
            if steps and name != "mine":
                shutil.rmtree(data.draw(st.sampled_from(steps)))

        @rule(name=NAMES, data=st.data())
        def corrupt_a_file(self, name, data):
            if name != "mine" and (found := self.regular_files(name)):
                path = data.draw(st.sampled_from(found))
                raw = bytearray(path.read_bytes() or b"\0")
                raw[len(raw) // 2] ^= 0xFF
                path.write_bytes(bytes(raw))

        @rule(name=NAMES, data=st.data())
        def replace_a_file_by_a_link(self, name, data):
            if name != "mine" and (found := self.regular_files(name)):
                path = data.draw(st.sampled_from(found))
                victim = self.root / "victims" / f"{len(self.protected)}-{path.name}"
                shutil.move(path, victim)
                path.symlink_to(victim)
                self.protected[victim] = victim.read_bytes()

        @invariant()
        def what_must_survive_survives(self):
            if hasattr(self, "protected"):
                assert {p: p.read_bytes() for p in self.protected} == self.protected

    return RunDirectories


def run_machine(base_run, capfd, examples: int, steps: int) -> None:
    pytest.importorskip("ctranslate2")
    run_state_machine_as_test(machine(base_run, capfd), settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_run_directory_operations_keep_what_must_survive(tiny_torch_run, capfd):
    run_machine(tiny_torch_run, capfd, examples=6, steps=10)
