"""The import contract: imports between tokenmill's parts flow one way, down this list.

This list is the architecture's order, written once; every ``import`` in the package (lazy ones
inside functions included) must go to its own part or to a part above it in the list, and
parts on one line must not import each other. So there is no cycle, and a part can be read,
tested and changed knowing only what lies above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tokenmill"

LAYERS: list[set[str]] = [
    {"tokenmill.errors"},
    {"tokenmill.paths"},
    {"tokenmill.options"},                         # config fields as flags and keyword arguments
    {"tokenmill.config"},                          # ModelConfig, LoadConfig
    {"tokenmill.device", "tokenmill.allocator"},   # the device; the CPU allocator's thresholds
    {"tokenmill.sampling_params"},
    {"tokenmill.chat_requests"},                   # generic chat requests a model answers (drafts, shortlists)
    {"tokenmill.kernels"},                         # C++ CPU kernels and the one place that picks them
    {"tokenmill.loading"},                         # sources, GGUF, safetensors, tokenizer, checkpoints
    {"tokenmill.attention"},                       # KV storage, step metadata, the backend
    {"tokenmill.lora"},                            # LoRA adapters: reading them, serving slots, the registry
    {"tokenmill.models"},                          # layers, families, model construction
    {"tokenmill.training"},                        # the training loop QAT, speculative heads, ... share
    {"tokenmill.engine"},                          # scheduler, KV manager, runner, sampler, LLMEngine
    {"tokenmill.eval"},                            # perplexity (over the engine's runner)
    {"tokenmill.quantization"},                    # quantized weights, methods, checkpoints
    {"tokenmill.pruning"},                         # sparse and structured pruning, the sparse kernel's layer
    {"tokenmill.distillation"},                    # teacher -> student training (KD, acceptance, QAD)
    {"tokenmill.upcycling"},                       # dense -> mixture-of-experts, trained by distillation
    {"tokenmill.finetune"},                        # LoRA fine-tuning from JSON-lines records
    {"tokenmill.loader"},                          # the facade: any model argument to a loaded model
    {"tokenmill.llm"},                             # the offline API
    {"tokenmill.spec_heads"},                      # training speculative heads on the model's own text
    {"tokenmill.routing"},                         # model routing's learned router (features, training)
    {"tokenmill.server", "tokenmill.benchmark"},
    {"tokenmill.costplan"},                        # cost planning over the offline benchmark
    {"tokenmill.scaleout"},                        # replicas on Ray Serve behind the server's front
    {"tokenmill.commands"},                        # one module per CLI command family
    {"tokenmill.cli"},
    {"tokenmill", "tokenmill.__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def unit_of(module: str) -> str:
    """The part a module belongs to: its subpackage (tokenmill.engine) or its top-level module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "tokenmill"
    return ".".join(parts[:2])


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int, list[str]]]:
    """(imported module, line, imported names) of every import statement in the file, lazy ones included."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((target, node.lineno, [alias.name for alias in node.names]))
    return [(m, line, names) for m, line, names in out if m == "tokenmill" or m.startswith("tokenmill.")]


def graph() -> list[tuple[str, str, str]]:
    """(importing unit, imported unit, where) for every import between two different parts."""
    edges = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = unit_of(module_name(path))
        for target, line, _ in imports_of(path):
            if unit_of(target) != source:
                edges.append((source, unit_of(target), f"{path.relative_to(PACKAGE.parent)}:{line}"))
    return edges


def violations(edges: list[tuple[str, str, str]]) -> list[str]:
    """Imports that go down the list (upward in the architecture), sideways, or to an unlisted part."""
    bad = []
    for source, target, where in edges:
        if source not in RANK or target not in RANK:
            bad.append(f"{where}: {source} -> {target}: a part missing from LAYERS")
        elif RANK[target] >= RANK[source]:
            bad.append(f"{where}: {source} imports {target}, which is not above it in LAYERS")
    return bad


def cycles(edges: list[tuple[str, str, str]]) -> list[list[str]]:
    """Cycles in the part graph (depth-first search); each as the list of parts around it."""
    succ: dict[str, set[str]] = {}
    for source, target, _ in edges:
        succ.setdefault(source, set()).add(target)
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(succ.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(succ):
        if node not in state:
            visit(node, [node])
    return found


def test_every_part_is_in_the_layer_list() -> None:
    units = {unit_of(module_name(p)) for p in PACKAGE.rglob("*.py")}
    assert units - RANK.keys() == set(), "add new parts to LAYERS (in their place in the order)"


def test_imports_flow_one_way() -> None:
    edges = graph()
    assert violations(edges) == []
    assert cycles(edges) == []


def test_the_checks_catch_a_cycle_and_an_upward_import() -> None:
    edges = [("tokenmill.loading", "tokenmill.errors", "a.py:1"), ("tokenmill.models", "tokenmill.loading", "b.py:1"),
             ("tokenmill.loading", "tokenmill.models", "c.py:9")]  # e.g. a lazy import inside a function
    assert cycles(edges) == [["tokenmill.loading", "tokenmill.models", "tokenmill.loading"]]
    assert violations(edges) == ["c.py:9: tokenmill.loading imports tokenmill.models, which is not above it in LAYERS"]
    assert violations([("tokenmill.server", "tokenmill.benchmark", "d.py:2")]) != []  # sideways


def test_lazy_imports_are_seen(tmp_path: Path) -> None:
    path = PACKAGE / "loading" / "sources.py"
    source = unit_of(module_name(path))
    lazy = ast.parse("def f():\n    from tokenmill.models.builder import build_model\n")
    found = [n.module for n in ast.walk(lazy) if isinstance(n, ast.ImportFrom)]
    assert found == ["tokenmill.models.builder"] and source == "tokenmill.loading"
    assert violations([(source, unit_of(found[0]), "sources.py:2")]) != []


def _engine_public_names() -> set[str]:
    tree = ast.parse((PACKAGE / "engine" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {ast.literal_eval(e) for e in node.value.elts}
    raise AssertionError("tokenmill/engine/__init__.py has no __all__")


@pytest.mark.parametrize("path", sorted((PACKAGE / "server").rglob("*.py")), ids=lambda p: p.name)
def test_the_server_uses_only_the_engines_public_api(path: Path) -> None:
    public = _engine_public_names()
    for target, line, names in imports_of(path):
        if unit_of(target) != "tokenmill.engine":
            continue
        assert target == "tokenmill.engine", f"{path.name}:{line} imports the engine's module {target}"
        assert set(names) <= public, f"{path.name}:{line} imports {set(names) - public}, not in engine.__all__"
    # and reads no private attribute of the engine's objects
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = ast.unparse(node.value)
            assert "engine" not in owner, f"{path.name}:{node.lineno} reads {owner}.{node.attr}"
