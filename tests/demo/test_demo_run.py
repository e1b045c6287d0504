"""``trainguard demo --help`` says what the demo does and what each option is, in plain text."""

from __future__ import annotations

import argparse

import pytest

from trainguard.demo import run


def test_the_help_names_every_option_with_its_meaning_and_no_markup(capsys, monkeypatch) -> None:
    parsers: list[argparse.ArgumentParser] = []
    real = argparse.ArgumentParser.parse_args

    def keep(self, *args, **kwargs):
        parsers.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as stop:
        run.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "no Docker" in text
    (parser,) = parsers
    unexplained = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert unexplained == []
