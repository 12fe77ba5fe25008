"""The shape of the package: rooms that import only the rooms below them, no import circle, no
function over 80 lines nor module over 500, and a job validated once, with the model built on meta
once for its checks."""

from __future__ import annotations

import ast
import os
import sys

import pytest

import ppsplit

ROOT = os.path.dirname(ppsplit.__file__)
# The rooms from the ground up; a module may import its own room and those before it.
ROOMS = ["", "config", "models", "data", "stages", "parallel", "checkpoint", "train", "launch", "report", "app"]
GROUND = {"errors", "output", "faults", "torch_private"}  # ppsplit/*.py every room stands on


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                parts = ["ppsplit", *os.path.relpath(os.path.join(folder, name), ROOT)[:-3].split(os.sep)]
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(folder, name)
    return out


def _imports(path: str) -> set[str]:
    """Every ppsplit module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ppsplit"):
            found.update(f"{node.module}.{a.name}" for a in node.names)
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ppsplit"))
    return found


def _room(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 2 and parts[1] in GROUND:
        return 0
    return ROOMS.index(parts[1]) if len(parts) > 1 and parts[1] in ROOMS else len(ROOMS)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        targets = set()
        for name in _imports(path):
            while name and name not in mods:  # "from ppsplit.x import f" names a function of ppsplit.x
                name = name.rpartition(".")[0]
            if name and name != mod and name != "ppsplit":
                targets.add(name)
        graph[mod] = targets
    return graph


def test_every_module_sits_in_a_room_and_imports_none_above_its_own():
    graph = _graph()
    rooms = {m: _room(m) for m in graph if m not in ("ppsplit", "ppsplit.__main__")}
    assert all(r < len(ROOMS) for r in rooms.values()), [m for m, r in rooms.items() if r == len(ROOMS)]
    upward = [f"{m} -> {t}" for m in rooms for t in graph[m] if t in rooms and rooms[t] > rooms[m]]
    assert upward == []


def test_no_import_circle():
    graph, seen, done, circles = _graph(), [], set(), []

    def visit(mod):
        seen.append(mod)
        for t in graph.get(mod, ()):
            if t in seen:
                circles.append(seen[seen.index(t):] + [t])
            elif t not in done:
                visit(t)
        seen.pop()
        done.add(mod)

    for mod in graph:
        if mod not in done:
            visit(mod)
    assert circles == []


def test_each_room_says_what_it_owns_and_what_it_may_import():
    for room in ROOMS[1:]:
        doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, room, "__init__.py")).read()))
        assert doc and "May import" in doc, room


def test_no_function_over_80_lines_no_module_over_500():
    long = []
    for mod, path in _modules().items():
        text = open(path).read()
        if len(text.splitlines()) > 500:
            long.append(f"{mod}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_a_run_validates_once_and_builds_the_model_on_meta_once_for_its_checks(tmp_path, monkeypatch):
    """The command line's guard validates the job; the job takes that validation, and every
    check that needs the model (its stage count, model.init=auto's parameter count) uses the
    one structure built on meta."""
    from ppsplit.app import checks, cli, job
    from ppsplit.models import build

    calls = {"validate": 0, "check_model": 0, "build_on_meta": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(checks, "validate", counted("validate", checks.validate))
    monkeypatch.setattr(job, "validate", checks.validate)
    monkeypatch.setattr(checks, "check_model", counted("check_model", checks.check_model))
    monkeypatch.setattr(build, "build_on_meta", counted("build_on_meta", build.build_on_meta))
    from ppsplit.launch import local

    monkeypatch.setattr(local, "allow_fork", lambda: None)  # this process has run tests: no fork of it
    monkeypatch.setattr(local, "shutdown_launcher", lambda *a, **k: None)  # nor an end to the suite's launcher
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["ppsplit", "launcher=inline", "steps=0", "model.init=auto",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    try:
        cli.main()
    except SystemExit as end:
        assert end.code in (0, None)
    assert (tmp_path / "run" / "report.json").is_file()
    assert calls == {"validate": 1, "check_model": 1, "build_on_meta": 0}


@pytest.mark.parametrize("argv", [["stagess=2"], ["+stages=3"], ["model.config.newkey=3"]])
def test_a_refused_composition_is_said_in_one_line_from_hydra_itself(argv):
    """A single run is composed once, by Hydra; what it refuses comes back as one line."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from ppsplit.app.cli import CONF_DIR
    from ppsplit.config.overrides import check_command_line, refusal

    check_command_line(argv, CONF_DIR, compose=False)  # nothing here needs the composed config
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        with pytest.raises(HydraException) as info:
            compose(config_name="config", overrides=argv)
    said = str(refusal(info.value, argv, CONF_DIR))
    assert argv[0] in said and "\n" not in said
