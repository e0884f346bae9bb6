"""The README runs as written.

Every ```python block of README.md is a complete program: it is run as its own process against a
real stack (the session's nats-server, an admitter, a router, two sim workers, an offline runner
and an open gateway, as ``natsched up --gateway`` runs them), must exit 0 and must print what the
```text block after it says (``…`` stands for any text). The curl command is run against the
same gateway. Every ``natsched …`` command line in the README's and docs/' shell blocks (and in
the README's inline code) must parse with the real command-line parser, so no documented command
or flag is missing.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import sys
from pathlib import Path

import orjson
import pytest

from natsched.cli.app import build_parser
from tests.admitter.test_offline_runner import start_runner
from tests.factories.gateway import start_gateway
from tests.factories.stack import start_stack

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
RUN_TIMEOUT_S = 180  # a hang guard, not a measurement


def fenced(text: str) -> list[tuple[str, str]]:
    """Every fenced block as (language, body), in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def programs(text: str) -> list[tuple[str, list[str]]]:
    """Each python block with the lines of the text block that follows it (what it prints)."""
    blocks = fenced(text)
    out = []
    for i, (lang, body) in enumerate(blocks):
        if lang == "python":
            follows = blocks[i + 1] if i + 1 < len(blocks) else ("", "")
            assert follows[0] == "text", f"python block {len(out) + 1} has no ```text block of its output after it"
            out.append((body, follows[1].rstrip("\n").split("\n")))
    return out


def shell_lines(text: str) -> list[str]:
    """The commands of every sh block: continuations joined, `&&` chains split."""
    lines = []
    for lang, body in fenced(text):
        if lang == "sh":
            for line in body.replace("\\\n", " ").splitlines():
                lines.extend(part.strip() for part in re.split(r"&&|\|\||;", line))
    return lines


def natsched_argv(line: str) -> list[str] | None:
    """``natsched ARGS`` (also as .venv/bin/natsched) without its comment, or None for any other line."""
    words = shlex.split(line, comments=True)
    if not words or Path(words[0]).name != "natsched":
        return None
    return words[1:]


def documented_commands() -> list[str]:
    found = []
    for path in [README, *DOCS]:
        text = path.read_text()
        for line in shell_lines(text):
            if natsched_argv(line) is not None:  # a synopsis' [options] must parse left out and written in
                found += sorted({re.sub(r"\[([^]]*)\]", r"\1", line), re.sub(r"\[[^]]*\]", "", line)})
        # inline commands in prose too, except the ones written as a syntax (a|b, [opt], …)
        found += [c for c in re.findall(r"`(natsched [^`]+)`", text) if not re.search(r"[|\[…<]|\.\.\.", c)]
    return found


def matches(expected: list[str], printed: list[str]) -> bool:
    if len(expected) != len(printed):
        return False
    return all(re.fullmatch(".*".join(map(re.escape, e.split("…"))), p) for e, p in zip(expected, printed))


PROGRAMS = programs(README.read_text())
COMMANDS = documented_commands()


def test_the_readme_has_programs_and_commands_to_check():
    """The checks below check something: the README keeps its producer, batch and SDK programs."""
    assert len(PROGRAMS) >= 3
    assert len(COMMANDS) >= 30
    assert any("openai" in body for body, _ in PROGRAMS)


def test_the_extractor_sees_through_chains_comments_and_continuations():
    text = "```sh\npython3 -m venv .venv && .venv/bin/natsched up --workers 2\nnatsched status \\\n  --json  # x\n```\n"
    argvs = [natsched_argv(line) for line in shell_lines(text)]
    assert [a for a in argvs if a is not None] == [["up", "--workers", "2"], ["status", "--json"]]
    assert matches(["done w…"], ["done w2"]) and not matches(["done w…"], ["failed w2"])
    with pytest.raises(SystemExit):  # what the parse check below relies on: a made-up flag is refused
        build_parser().parse_args(natsched_argv("natsched up --no-such-flag"))


@pytest.mark.parametrize("line", COMMANDS)
def test_documented_command_parses(line, capsys):
    try:
        build_parser().parse_args(natsched_argv(line))
    except SystemExit as e:  # argparse refuses an unknown command or flag with exit 2; --help exits 0
        if e.code != 0:
            pytest.fail(f"{line!r} does not parse (exit {e.code}): {capsys.readouterr().err}")


@pytest.fixture
async def system(bus, nats_url):
    """What ``natsched up --gateway`` runs, in this process, on the session's server."""
    stack = await start_stack(nats_url, workers=2, policy="natsched", time_scale=0.05)
    _, runner_bus = await start_runner(nats_url)
    stack.buses.append(runner_bus)
    gateway = await start_gateway(nats_url, open_tenant="open")
    await gateway.wait_for_workers(2)
    try:
        yield nats_url, gateway
    finally:
        await gateway.close()
        await stack.close()


async def run(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*argv, cwd=cwd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), RUN_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        out, err = await proc.communicate()
    return proc.returncode, out.decode(), err.decode()


def environment(nats_url: str, gateway) -> dict[str, str]:
    env = dict(os.environ, NATSCHED_NATS_URL=nats_url, OPENAI_BASE_URL=gateway.url + "/v1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # this checkout's natsched
    return env


@pytest.mark.parametrize("number", range(1, len(PROGRAMS) + 1))
async def test_readme_program_runs_and_prints_what_the_readme_says(number, system, tmp_path):
    body, expected = PROGRAMS[number - 1]
    code, out, err = await run([sys.executable, "-c", body], tmp_path, environment(*system))
    assert code == 0, f"program {number} exited {code}:\n{err}"
    printed = out.rstrip("\n").split("\n")
    assert matches(expected, printed), f"program {number} printed:\n{out}\nthe README says:\n" + "\n".join(expected)


async def test_readme_curl_command_gets_a_completion(system, tmp_path):
    nats_url, gateway = system
    [curl] = [line for line in shell_lines(README.read_text()) if line.startswith("curl ")]
    assert "localhost:8000" in curl
    code, out, err = await run(["bash", "-c", curl.replace("localhost:8000", gateway.url.removeprefix("http://"))],
                               tmp_path, environment(nats_url, gateway))
    assert code == 0, err
    reply = orjson.loads(out)
    assert reply["object"] == "text_completion"
    assert reply["choices"][0]["text"].split() == ["tok0", "tok1", "tok2", "tok3"]


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("path", [README, *DOCS, ROOT / "subjects.md", ROOT / "compose" / "README.md",
                                  ROOT / "natsched" / "sim" / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_reaches_a_file_and_its_heading(path):
    for target in LINK.findall(FENCE.sub("", path.read_text())):
        if re.match(r"\w+://", target):
            continue
        file, _, fragment = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        assert dest.exists(), f"{path.name}: {target} -> no such file"
        if fragment and dest.suffix == ".md":
            assert fragment in anchors(dest), f"{path.name}: {target} -> no such heading in {dest.name}"
