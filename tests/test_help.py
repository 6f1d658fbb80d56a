"""Every flag of every command says what it does: the parsers are walked, not their printed
help (a wrapped line would hide a flag from a reader of the text)."""

import argparse
import re

import pytest
import tyro

from jaxdist.cli.main import COMMANDS, INT_LISTS


def _undescribed(parser: argparse.ArgumentParser) -> list[str]:
    """Flags whose help holds nothing but their default, through every nested subparser."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out += _undescribed(sub)
        elif action.option_strings and action.help != argparse.SUPPRESS:
            plain = re.sub(r"\x1b\[[0-9;]*m", "", action.help or "")  # rich's colours
            if not re.sub(r"\(default[^)]*\)", "", plain).strip():
                out.append(action.option_strings[0])
    return [flag for flag in out if flag not in ("-h", "--help")]


# tyro.extras.get_parser is deprecated in tyro 1.0 (pinned) without a replacement that returns
# the parser; the flags are read from argparse's own actions.
@pytest.mark.filterwarnings("ignore:get_parser\\(\\) is deprecated:DeprecationWarning")
@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_of_every_command_is_described(command):
    with INT_LISTS:
        parser = tyro.extras.get_parser(COMMANDS[command][0])
    assert _undescribed(parser) == []
