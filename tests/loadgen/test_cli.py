"""The command line's own pieces: option parsing, masking secrets, writing output whole."""

from __future__ import annotations

import io

import pytest

from loadgen.cli import emit, masked_argv, parse_goodput, parse_headers


class PartialPipe(io.RawIOBase):
    """A file descriptor that takes at most 5000 bytes a write, as a busy pipe may."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        taken = bytes(b[:5000])
        self.data += taken
        return len(taken)


def unbuffered_stdout() -> tuple[io.TextIOWrapper, PartialPipe]:
    raw = PartialPipe()
    return io.TextIOWrapper(raw, encoding="utf-8", write_through=True), raw  # what PYTHONUNBUFFERED gives


def test_emit_writes_everything_where_a_plain_write_loses_the_tail():
    text = "".join(f"line {i} ≤ ±\n" for i in range(20_000))
    plain, raw = unbuffered_stdout()
    plain.write(text)
    plain.flush()
    assert len(raw.data) < len(text.encode())  # the interpreter's own behaviour: the tail is gone
    stream, raw = unbuffered_stdout()
    emit(stream, text)
    assert raw.data.decode() == text


def test_secrets_are_masked_in_the_saved_command():
    argv = ["--api-key", "sk-1", "--header", "Authorization: Bearer x", "--header=X-Key: y", "--api-key=sk-2", "--model", "m"]
    assert masked_argv(argv) == ["--api-key", "***", "--header", "Authorization: ***", "--header=X-Key: ***", "--api-key=***", "--model", "m"]


def test_goodput_and_header_options():
    assert parse_goodput(["ttft:500", "TPOT=50", "e2e:2500.5"]) == {"ttft": 500.0, "tpot": 50.0, "e2e": 2500.5}
    assert parse_headers(["X-A: 1", "x-b:two words "]) == {"x-a": "1", "x-b": "two words"}
    for bad in (["ttft"], ["ttft:fast"]):
        with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
            parse_goodput(bad)
    with pytest.raises(ValueError, match="Name: value"):
        parse_headers(["no colon"])
