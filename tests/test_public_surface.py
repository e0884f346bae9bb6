"""``import natsched``: the curated names resolve, and importing the package alone stays light."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import natsched

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("vllm", "torch", "starlette", "uvicorn", "nats", "natsched.sim", "natsched.gateway", "natsched.cli")


def test_every_name_in_all_resolves():
    assert len(set(natsched.__all__)) == len(natsched.__all__)
    for name in natsched.__all__:
        assert getattr(natsched, name) is not None, name
    assert natsched.__version__ == version("natsched")
    assert set(natsched.__all__) <= set(dir(natsched))


def test_the_errors_are_one_tree():
    for name in ("RequestError", "Rejected", "RequestTimeout", "RequestFailed", "DuplicateRequest"):
        assert issubclass(getattr(natsched, name), natsched.NatschedError), name
    for name in ("Rejected", "RequestTimeout", "RequestFailed", "DuplicateRequest"):
        assert issubclass(getattr(natsched, name), natsched.RequestError), name


def test_an_unknown_name_is_an_attribute_error():
    try:
        natsched.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("natsched.NoSuchThing resolved")


def _under(module: str, roots) -> bool:
    return any(module == r or module.startswith(r + ".") for r in roots)


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    return set(out.stdout.split())


def test_import_natsched_imports_nothing_heavy():
    loaded = _loaded_after("import natsched")
    assert {m for m in loaded if _under(m, HEAVY)} == set()
    assert "natsched" in loaded


def test_the_client_brings_nats_but_not_the_engines_the_http_stack_or_the_simulator():
    loaded = _loaded_after("import natsched\nnatsched.Client")
    assert "nats" in loaded  # the client does need its transport
    assert {m for m in loaded if _under(m, HEAVY) and not _under(m, ("nats",))} == set()
