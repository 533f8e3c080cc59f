"""The assertion every user-mistake test makes about the command line."""

from __future__ import annotations

from tttvideo.cli import main


def one_error_line(capsys, argv: list[str], *needles: str) -> str:
    """`tttv ARGV` exits 2 with exactly one stderr line holding every needle, and no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
