"""The table of launch/train.py's flags in docs/configuration.md against the parser itself
(launch/config/cli.py: training_parser): every flag a user can pass has exactly one row, no row names a
flag the parser lacks, and each default the table states is the one a run gets. The table is the
only list of the flags, so a flag added to the parser without a row fails here."""
import argparse
import re
from pathlib import Path

import pytest

from launch.config.cli import parse_training_args, training_parser
from launch.errors import REPO_ROOT

TABLE_HEADING = "## The flags of launch/train.py"
FLAG = re.compile(r"--[a-z][a-z0-9_-]*")


def documented_flags(doc: Path = REPO_ROOT / "docs" / "configuration.md") -> dict:
    """{flag: the default cell without backticks ('' when none)} from the table under TABLE_HEADING:
    the rows of `| flag | default | meaning |` up to the first line that is not a table row."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    start = lines.index(TABLE_HEADING)
    header = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == ["flag", "default", "meaning"], lines[header]
    rows = {}
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        flags = FLAG.findall(cells[0].split()[0])  # `--wandb online|offline|disabled`: the flag is the first word
        assert len(flags) == 1, f"one flag per row: {line}"
        assert flags[0] not in rows, f"{flags[0]} has two rows"
        rows[flags[0]] = cells[1].strip("`")
    return rows


def parser_flags(parser: argparse.ArgumentParser) -> dict:
    """{option string: its action} for every option a user passes: --help and SUPPRESS-ed options
    (the launcher's --local_rank) left out."""
    return {option: action for action in parser._actions
            if not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS
            for option in action.option_strings}


def shown(value) -> str:
    """A default as the table writes it: nothing for an absent one, a recipe path from the repository root."""
    if value is None or value is False or value == []:
        return ""
    if isinstance(value, Path):
        return value.relative_to(REPO_ROOT).as_posix()
    return str(value)


def test_every_flag_has_one_row_and_no_row_names_a_missing_flag():
    documented, parsed = set(documented_flags()), set(parser_flags(training_parser()))
    assert parsed - documented == set(), "flags of launch/config/cli.py without a row in docs/configuration.md"
    assert documented - parsed == set(), "rows of docs/configuration.md naming flags the parser lacks"


def test_each_default_is_the_parsers():
    """The default a run gets with the flag left out: parse_training_args([]) (--tp and --pp become 1
    there unless --layout auto picks them)."""
    defaults = vars(parse_training_args([]))
    actions = parser_flags(training_parser())
    wrong = {flag: (cell, shown(defaults[actions[flag].dest]))
             for flag, cell in documented_flags().items()
             if flag in actions and cell != shown(defaults[actions[flag].dest])}  # a row without a flag: above
    assert wrong == {}, "flag: (the table's default, the parser's)"


def test_the_check_sees_a_flag_added_without_a_row():
    """The mechanism: a flag added to the parser and a row without a flag are both found."""
    parser = training_parser()
    parser.add_argument("--new-flag", type=int)
    assert "--new-flag" in set(parser_flags(parser)) - set(documented_flags())
    assert "--local_rank" not in parser_flags(parser) and "--help" not in parser_flags(parser)


def test_the_table_reader_sees_a_row_without_a_flag(tmp_path):
    doc = tmp_path / "configuration.md"
    doc.write_text(f"{TABLE_HEADING}\n\n| flag | default | meaning |\n|---|---|---|\n"
                   "| `--gone N` | `2` | a removed flag |\n| `--wandb a\\|b` | | modes |\n"
                   "\nprose\n| `--not-a-row` | | |\n")
    assert documented_flags(doc) == {"--gone": "2", "--wandb": ""}
    assert "--gone" in set(documented_flags(doc)) - set(parser_flags(training_parser()))


@pytest.mark.parametrize("value, text", [(None, ""), (False, ""), ([], ""), (0, "0"), (3, "3"),
                                         (REPO_ROOT / "recipes" / "demo.yaml", "recipes/demo.yaml")])
def test_shown(value, text):
    assert shown(value) == text
