"""The batch/jobs/audit/replay/offline/retention parsers fit the real top-level ``natsched`` parser."""

import argparse

import pytest

from natsched.cli.app import build_parser
from natsched.cli.jobs import COMMANDS


def top_level_with_ours() -> argparse.ArgumentParser:
    """natsched/cli/app.py's parser: it calls add_parsers(sub) beside every other command."""
    return build_parser()


def test_every_command_parses_next_to_the_existing_ones():
    parser = top_level_with_ours()
    args = parser.parse_args(["batch", "submit", "f.jsonl", "--tenant", "t1", "--rate", "5", "--resume"])
    assert (args.command, args.action, args.tenant, args.rate, args.resume, args.cls) == (
        "batch", "submit", "t1", 5.0, True, "batch")
    assert parser.parse_args(["audit", "--since", "15m", "--tenant", "t1"]).request_id is None
    assert parser.parse_args(["replay", "--since", "1h", "--policy", "round_robin"]).policy == "round_robin"
    assert parser.parse_args(["offline", "--low-watermark", "0.4"]).low_watermark == 0.4
    assert parser.parse_args(["jobs", "list", "--status", "failed"]).status == "failed"
    assert parser.parse_args(["retention", "set", "REQUESTS", "--max-age", "14d"]).max_age == "14d"
    assert set(COMMANDS) <= set(next(a for a in parser._actions
                                     if isinstance(a, argparse._SubParsersAction)).choices)


@pytest.mark.parametrize("argv", [["batch", "submit", "f.jsonl", "--tenant", "t1", "--rate", "0"],
                                  ["batch", "submit", "f.jsonl"],
                                  ["replay", "--policy", "x"],
                                  ["audit", "--since", "yesterday"],
                                  ["batch", "submit", "f.jsonl", "--tenant", "t1", "--class", "gold"]])
def test_bad_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as err:
        top_level_with_ours().parse_args(argv)
    assert err.value.code == 2 and "error:" in capsys.readouterr().err
