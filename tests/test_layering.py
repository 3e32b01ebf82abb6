"""The daemon's composition root: each subsystem owns its settings type and only the root imports
daemon/config.py, which composes them (so the configuration and the subsystems never import each
other in a circle).

The checks read the source with `ast` (no import runs), so an import inside a function or under
`if TYPE_CHECKING:` counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Our folders and the packages they install as (pyproject.toml's package-dir).
PACKAGE_FOLDERS = {"dedloc.daemon": ROOT / "daemon", "dedloc.sim": ROOT / "dedloc" / "sim",
                   "dedloc.cli": ROOT / "cli", "dedloc.rpc": ROOT / "rpc"}
CONFIG = "dedloc.daemon.config"
# The modules that build the node from its configuration, and so may import daemon/config.py.
COMPOSITION_ROOT = {"dedloc.daemon", "dedloc.daemon.__main__", CONFIG, "dedloc.daemon.node",
                    "dedloc.daemon.network", "dedloc.daemon.main", "dedloc.daemon.reference"}
# What daemon/config.py may pull in of the collaboration and averaging packages: their settings
# types and what checking those settings needs (a run token's format and the run key it carries,
# the training hours' syntax).
CONFIG_MAY_REACH = {"dedloc.daemon.averaging", "dedloc.daemon.averaging.settings",
                    "dedloc.daemon.collab", "dedloc.daemon.collab.settings",
                    "dedloc.daemon.collab.availability", "dedloc.daemon.collab.tokens",
                    "dedloc.daemon.collab.secrecy", "dedloc.daemon.collab.errors"}


@dataclass(frozen=True)
class Import:
    module: str  # the dotted name imported
    line: int
    type_checking_only: bool


def module_files() -> dict[str, Path]:
    """Every module of ours by dotted name (a package by its own name, for its __init__.py)."""
    modules = {}
    for package, folder in PACKAGE_FOLDERS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = module_files()


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """Ids of the statements under `if TYPE_CHECKING:`."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                inside.update(id(child) for child in ast.walk(statement))
    return inside


def imports_of(name: str) -> Iterator[Import]:
    """The modules of ours that module `name` imports, wherever the import statement is."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    type_checking = _type_checking_blocks(tree)
    package = name if is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from package import module` imports the module too
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            if target in MODULES:
                yield Import(target, node.lineno, id(node) in type_checking)


def reached_from(start: str) -> set[str]:
    """The modules importing `start` runs, following imports wherever they are in a module
    (those under TYPE_CHECKING are never run) and the __init__ of each package on the way,
    except the daemon package's own (the root re-exports the Node from there)."""
    seen = {start}
    todo = [start]
    while todo:
        for found in imports_of(todo.pop()):
            if found.type_checking_only:
                continue
            parts = found.module.split(".")
            for end in range(3, len(parts) + 1):  # dedloc.daemon.x, dedloc.daemon.x.y, ...
                name = ".".join(parts[:end])
                if name in MODULES and name not in seen:
                    seen.add(name)
                    todo.append(name)
    return seen


def test_no_subsystem_imports_the_configuration() -> None:
    offenders = [f"{MODULES[name].relative_to(ROOT)}:{found.line}"
                 for name in sorted(MODULES)
                 if name.startswith(("dedloc.daemon", "dedloc.sim")) and name not in COMPOSITION_ROOT
                 for found in imports_of(name) if found.module == CONFIG]
    assert not offenders, ("these modules import daemon/config.py; pass them their own settings "
                           f"type (daemon/<subsystem>/settings.py) instead: {offenders}")


def test_the_configuration_reaches_only_settings_of_collab_and_averaging() -> None:
    reached = reached_from(CONFIG) - {CONFIG}
    cycle = sorted(name for name in reached
                   if any(found.module == CONFIG and not found.type_checking_only
                          for found in imports_of(name)))
    assert not cycle, f"daemon/config.py imports modules that import it back: {cycle}"
    root = sorted(reached & COMPOSITION_ROOT)
    assert not root, f"daemon/config.py imports the composition root back: {root}"
    beyond = sorted(name for name in reached - CONFIG_MAY_REACH
                    if name.startswith(("dedloc.daemon.collab", "dedloc.daemon.averaging")))
    assert not beyond, f"daemon/config.py pulls in subsystem code beyond settings: {beyond}"


def test_the_import_reader_sees_relative_lazy_and_type_checking_imports() -> None:
    """The reader itself: runs.py's imports, as written in its source, are all found."""
    found = {i.module: i for i in imports_of("dedloc.daemon.collab.runs")}
    assert "dedloc.daemon.timebase" in found  # from .. import timebase
    assert "dedloc.daemon.workers.process" in found  # from ..workers.process import ...
    assert found["dedloc.daemon.network"].type_checking_only  # under TYPE_CHECKING
    lazy = {i.module for i in imports_of(CONFIG)}
    assert "dedloc.daemon.web.server" in lazy  # imported inside _check_dashboard
