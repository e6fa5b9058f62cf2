"""Issue 19, item 6: `servekeeper secret set` takes no value on the command line (argv is seen by
`ps` and kept in shell history): `KEY=-` reads the value from standard input, `--from-file
KEY=PATH` from a file."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from servekeeper.cli import common as cli_common
from servekeeper.cli.main import app
from servekeeper.store.secrets import MAX_SECRET_FILE_BYTES, read_secrets, secrets_dir


@pytest.fixture(autouse=True)
def wide_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_common, "errors", Console(width=300, stderr=True))  # no wrapped lines


def secret_set(state_dir: Path, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["secret", "set", *args, "--state-dir", str(state_dir)], input=stdin)
    return result.exit_code, result.stdout, result.stderr


def test_a_value_on_the_command_line_is_refused_and_says_how(tmp_path: Path) -> None:
    code, _, errors = secret_set(tmp_path, "db", "password=hunter2")
    assert code == 1
    assert "password=-" in errors and "--from-file password=PATH" in errors
    assert "hunter2" not in errors
    assert read_secrets(secrets_dir(tmp_path)) == {}


def test_a_value_from_standard_input(tmp_path: Path) -> None:
    code, out, _ = secret_set(tmp_path, "db", "password=-", stdin="s3cr=t\n")
    assert code == 0, out
    assert read_secrets(secrets_dir(tmp_path)) == {"db": {"password": "s3cr=t"}}  # the one newline dropped


def test_values_from_files_and_stdin_together(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("-----BEGIN-----\nabc\n-----END-----\n")
    code, out, _ = secret_set(tmp_path, "tls", "key=-", "--from-file", f"cert={tmp_path / 'cert.pem'}", stdin="k")
    assert code == 0, out
    assert read_secrets(secrets_dir(tmp_path)) == {
        "tls": {"key": "k", "cert": "-----BEGIN-----\nabc\n-----END-----\n"}  # a file as it is
    }


def test_bad_sources_are_refused_by_name(tmp_path: Path) -> None:
    code, _, errors = secret_set(tmp_path, "db", "--from-file", f"cert={tmp_path / 'missing.pem'}")
    assert code == 1 and "missing.pem" in errors
    code, _, errors = secret_set(tmp_path, "db", "a=-", "b=-", stdin="x")
    assert code == 1 and "standard input" in errors
    code, _, errors = secret_set(tmp_path, "db")
    assert code == 1 and "KEY=-" in errors
    assert read_secrets(secrets_dir(tmp_path)) == {}


def test_a_file_is_taken_byte_for_byte_whatever_its_line_ends(tmp_path: Path) -> None:
    """`read_text()` turned CRLF and CR into LF (and decoded with the locale's encoding)."""
    (tmp_path / "key.txt").write_bytes("crlf\r\ncr\rlf\n\u00e9\r\n".encode())
    code, out, _ = secret_set(tmp_path, "db", "--from-file", f"key={tmp_path / 'key.txt'}")
    assert code == 0, out
    assert read_secrets(secrets_dir(tmp_path)) == {"db": {"key": "crlf\r\ncr\rlf\n\u00e9\r\n"}}


def test_a_file_that_is_not_utf8_or_too_large_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9")
    code, _, errors = secret_set(tmp_path, "db", "--from-file", f"key={tmp_path / 'latin1.txt'}")
    assert code == 1 and "'key'" in errors and "latin1.txt" in errors and "UTF-8" in errors
    (tmp_path / "big.bin").write_bytes(b"a" * (MAX_SECRET_FILE_BYTES + 1))
    code, _, errors = secret_set(tmp_path, "db", "--from-file", f"big={tmp_path / 'big.bin'}")
    assert code == 1 and "'big'" in errors and "big.bin" in errors and "larger than" in errors
    # An endless file (a device) ends at the cap instead of filling the memory.
    code, _, errors = secret_set(tmp_path, "db", "--from-file", "zero=/dev/zero")
    assert code == 1 and "/dev/zero" in errors and "larger than" in errors
    assert read_secrets(secrets_dir(tmp_path)) == {}


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["k=-", "--from-file", "k=FILE"], id="stdin-and-file"),
        pytest.param(["--from-file", "k=FILE", "--from-file", "k=FILE"], id="two-files"),
    ],
)
def test_a_key_given_twice_is_refused(tmp_path: Path, args: list[str]) -> None:
    """The last one silently won."""
    (tmp_path / "value.txt").write_text("from the file")
    args = [arg.replace("FILE", str(tmp_path / "value.txt")) for arg in args]
    code, _, errors = secret_set(tmp_path, "db", *args, stdin="from stdin")
    assert code == 1 and "'k'" in errors and "twice" in errors
    assert read_secrets(secrets_dir(tmp_path)) == {}
