"""The package's import graph, read from source: no cycles, every import between packages points down the layers,
and imports inside functions only of optional dependencies, each saying why on its line."""

from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import Import, cycles, internal_edges, package_modules, read_imports

ROOT = Path(__file__).resolve().parents[1] / "src" / "specdec"

# Lower layers know nothing of higher ones; a package imports only from lower layers (within itself: acyclic).
LAYERS = {
    "specdec.version": 0, "specdec.errors": 0, "specdec.host": 0,  # what the machine and the user's input can be
    "specdec.config": 1,  # the options of a run, checked
    "specdec.fim": 1,  # fill-in-the-middle prompt layouts (pure; a backend names its FIM tokens with it)
    "specdec.toolcalls": 1,  # tool-call formats, parsing and grammars (pure text)
    "specdec.core": 2,  # the math: sampling, verification, statistics, intervals, cost curves
    "specdec.grammar": 2,  # JSON schemas as logits processors (llguidance)
    "specdec.backends": 3,  # model passes and their caches
    "specdec.drafters": 4, "specdec.kpolicy": 4, "specdec.loading": 4,
    "specdec.engine": 5,  # the scheduler: one decode loop
    "specdec.decoder": 6,  # the loaded pair, the library's entry
    "specdec.cli": 7,  # the shared flags and `specdec generate`
    "specdec.server": 8, "specdec.bench": 8,
    "specdec.tune": 9, "specdec.distill": 9,  # both run the bench
    "specdec.cli.main": 10, "specdec": 10,  # the console script and the package's lazy names load what they serve
}

# The only third-party modules a function may import: an optional extra (or the ray extra behind one of our
# modules), whose import at the top would make the module unimportable without it; and transformers, whose model
# classes take seconds to import: at the top they would double the console script's start (measured 2.7 -> 5.3 s
# to build the parser on the 2-vCPU EPYC).
OPTIONAL = {"llama_cpp", "matplotlib", "httpx", "jsonschema", "uvicorn", "ray", "peft", "transformers", "specdec.server.ray_serve",
            "specdec.grammar.compiler"}  # the grammar compiler: llguidance's glue imports transformers (6.7 s), needed on first schema


def layer_of(module: str) -> tuple[str, int]:
    owner = max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len)
    return owner, LAYERS[owner]


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return read_imports(ROOT)


def test_every_module_has_a_layer():
    assert all(layer_of(module)[0] for module in package_modules(ROOT))


def test_no_import_cycles(imports):
    assert cycles(internal_edges(imports, "specdec")) == []


def test_imports_between_packages_point_down(imports):
    wrong = []
    for imp in imports:
        if imp.target != "specdec" and not imp.target.startswith("specdec."):
            continue
        (owner, level), (target_owner, target_level) = layer_of(imp.importer), layer_of(imp.target)
        if owner != target_owner and target_level >= level:
            wrong.append(f"{imp.importer}:{imp.line} -> {imp.target}")
    assert wrong == []


def test_function_local_imports_are_optional_dependencies_and_say_so(imports):
    wrong = []
    for imp in imports:
        if not imp.local or imp.by_name:
            continue
        line = package_modules(ROOT)[imp.importer].read_text().splitlines()[imp.line - 1]
        if imp.target not in OPTIONAL or "#" not in line:
            wrong.append(f"{imp.importer}:{imp.line}: {line.strip()}")
    assert wrong == []


# Negative controls: the checks above would see what they forbid.

def test_the_checks_see_a_cycle_an_upward_import_and_a_local_import(tmp_path):
    package = tmp_path / "specdec"
    (package / "core").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "core" / "__init__.py").write_text("")
    (package / "core" / "a.py").write_text("from specdec.core import b\n")
    (package / "core" / "b.py").write_text("import specdec.core.a\n\ndef f():\n    import torch\n"
                                           "    from specdec.engine import loop\n")
    (package / "engine").mkdir()
    (package / "engine" / "__init__.py").write_text("")
    (package / "engine" / "loop.py").write_text("")
    found = read_imports(package)
    assert cycles(internal_edges(found, "specdec")) == [["specdec.core.a", "specdec.core.b"]]
    upward = [i for i in found if i.target == "specdec.engine.loop"]
    assert upward and upward[0].local and layer_of(upward[0].target)[1] > layer_of(upward[0].importer)[1]
    assert any(i.local and i.target == "torch" for i in found)


def test_lazy_names_count_as_imports(tmp_path):
    package = tmp_path / "specdec"
    package.mkdir()
    (package / "__init__.py").write_text("import importlib\n_LAZY = {'X': 'specdec.inner'}\n"
                                         "def __getattr__(n):\n    return importlib.import_module(_LAZY[n])\n")
    (package / "inner.py").write_text("")
    assert any(i.importer == "specdec" and i.target == "specdec.inner" and i.by_name for i in read_imports(package))
