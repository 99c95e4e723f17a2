"""Running a CLI's `main` in the test's process: (exit status, stdout, stderr)."""

from __future__ import annotations

import io
import sys


def run_cli(main, capsys, *args: str, stdin: bytes | None = None, monkeypatch=None) -> tuple[int, str, str]:
    """main(args) with `stdin` as standard input (needs `monkeypatch`); a parser.exit counts as the status."""
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    try:
        code = main(list(args))
    except SystemExit as exit_info:
        code = exit_info.code
    out, err = capsys.readouterr()
    return code, out, err
