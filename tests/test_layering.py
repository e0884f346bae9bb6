"""The layering of the code, checked on its source (``ast``: nothing is imported or run).

Two tables say who may import what; a new rule is a new row:

- :data:`CONFINED`: a package (or module) and the only part of natsched that may import it.
  ``nats`` belongs to the transport, ``natsched/bus/``: services get handles from it.
- :data:`ALLOWED`: a part of natsched and everything its modules may import besides the
  standard library. ``natsched/wire/`` is the contract every process shares; it stands on
  nothing but itself, the root error, its two codecs and msgspec (the schema engine decodes with it).

Nor may code outside the transport reach through a Bus into its nats objects (``bus.js``,
``bus.nc``, ``js._nc``): :data:`TRANSPORT_ATTRIBUTES`.

Every import counts, wherever it is written (in a function, under ``TYPE_CHECKING``): an
import that only type checkers see still ties the layers together.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "natsched"

#: top-level import name -> the natsched parts (package prefixes) that alone may import it
CONFINED: dict[str, tuple[str, ...]] = {
    "nats": ("natsched.bus",),
    "opentelemetry": ("natsched.tracing",),  # optional (the tracing extra): imported only there, lazily
}

#: natsched part -> what its modules may import besides the standard library (name prefixes)
ALLOWED: dict[str, tuple[str, ...]] = {
    "natsched.wire": ("natsched.wire", "natsched.errors", "msgpack", "msgspec", "orjson"),
}

#: attributes that hold nats objects (the Bus's connection and JetStream context): bus/ only
TRANSPORT_ATTRIBUTES = {"js", "nc", "_js", "_nc"}
TRANSPORT = "natsched.bus"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            # ``from X import Y`` counts as X.Y: Y may be a module (``from natsched import errors``)
            base = (node.module or "").split(".") if not node.level else module.split(".")
            if node.level:
                base = base[: len(base) - node.level + (1 if is_package else 0)] + (node.module or "").split(".")
            out += [(node.lineno, ".".join([p for p in base if p] + [alias.name])) for alias in node.names]
    return out


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(module: str, found: list[tuple[int, str]]) -> list[str]:
    """What in ``found`` (the imports of ``module``) breaks :data:`CONFINED` or :data:`ALLOWED`."""
    out = []
    for line, name in found:
        top = name.split(".")[0]
        owners = CONFINED.get(top)
        if owners is not None and not any(within(module, o) for o in owners):
            out.append(f"{module}:{line} imports {name}, which only {', '.join(owners)} may import")
        for part, allowed in ALLOWED.items():
            if within(module, part) and top not in sys.stdlib_module_names and top != "__future__" \
                    and not any(within(name, a) for a in allowed):
                out.append(f"{module}:{line} imports {name}; {part} may import only {', '.join(allowed)} "
                           "and the standard library")
    return out


def reaches_into_transport(module: str, source: str) -> list[str]:
    """``x.js`` / ``x.nc`` (and the private spellings) in a module outside :data:`TRANSPORT`."""
    if within(module, TRANSPORT):
        return []
    return [f"{module}:{node.lineno} uses .{node.attr}: ask the Bus for a handle instead"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and node.attr in TRANSPORT_ATTRIBUTES]


def shipped_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_shipped_module_keeps_to_the_layers():
    problems = []
    for path in shipped_modules():
        module = module_name(path)
        problems += violations(module, imports(path.read_text(), module, path.name == "__init__.py"))
    assert not problems, "\n".join(problems)


def test_no_module_outside_the_transport_holds_its_nats_objects():
    problems = []
    for path in shipped_modules():
        problems += reaches_into_transport(module_name(path), path.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("module, source, broken", [
    ("natsched.ops.status", "await bus.js.stream_info(s)\n", True),
    ("natsched.gateway.app", "ok = gw.client.bus.nc.is_connected\n", True),
    ("natsched.audit.records", "nc = js._nc\n", True),
    ("natsched.ops.status", "await bus.stream(s).info()\nx = 'bench.js.>'\n", False),
    ("natsched.bus.streams", "await self.bus.js.get_msg(s, 1)\n", False),
])
def test_the_checker_sees_a_reach_into_the_transport(module, source, broken):
    assert bool(reaches_into_transport(module, source)) is broken


def test_the_tables_name_parts_that_exist():
    modules = {module_name(p) for p in shipped_modules()}
    for part in (*ALLOWED, *(o for owners in CONFINED.values() for o in owners)):
        assert part in modules, f"{part} is in a layering table but not in the package"


@pytest.mark.parametrize("module, source, broken", [
    ("natsched.admitter.service", "import nats\n", True),
    ("natsched.admitter.service", "from nats.js import api\n", True),
    ("natsched.admitter.service", "def f():\n    from nats.errors import TimeoutError\n", True),
    ("natsched.admitter.service", "from natsched.bus.connection import Bus\n", False),
    ("natsched.admitter.service", "import natsdata\n", False),  # a prefix of the name is not the package
    ("natsched.bus.kv", "from nats.js.errors import KeyNotFoundError\n", False),
    ("natsched.wire.codec", "import msgpack, orjson, hashlib\nfrom natsched.errors import NatschedError\n", False),
    ("natsched.wire.codec", "from natsched.bus.connection import Bus\n", True),
    ("natsched.wire.codec", "from ..bus import errors\n", True),
    ("natsched.wire.codec", "from . import schema\n", False),
    ("natsched.wire.codec", "import numpy\n", True),
    ("natsched.wire.codec", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nats\n", True),
])
def test_the_checker_sees_what_breaks_a_layer(module, source, broken):
    assert bool(violations(module, imports(source, module))) is broken


def test_a_relative_import_in_a_package_init_resolves_from_the_package():
    assert imports("from . import codec\nfrom .. import errors\n", "natsched.wire", is_package=True) == \
        [(1, "natsched.wire.codec"), (2, "natsched.errors")]


def test_from_a_package_import_a_module_names_the_module():
    assert imports("from natsched import errors\nfrom natsched.wire.schema import Request\n", "natsched.wire.x") == \
        [(1, "natsched.errors"), (2, "natsched.wire.schema.Request")]
