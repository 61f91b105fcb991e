"""The layers of nsa/ and train/, declared once here, and kept: every import statement of both packages
(top level and inside functions, read from the source, not executed) goes down the order below or stays
inside its own package; none crosses to a sibling of the same layer, none runs back up, and no chain of
imports comes back to where it started. docs/ARCHITECTURE.md and the README's Layout section show this
order; a test checks that ARCHITECTURE.md names every layer's packages in it.

A module belongs to the entry with the longest matching prefix (an entry `a.b` holds `a.b` and
`a.b.*`). Entries of one layer are siblings: they must not import each other."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (layer, entries, what it holds), lowest first. A module may import its own entry's modules and any
# entry of a lower layer.
COMMANDS = ("train.__main__", "train.analyze", "train.artifacts", "train.compare", "train.env", "train.evaluate",
            "train.export_hf", "train.generate", "train.import_hf", "train.launch", "train.plan", "train.postrun", "train.preflight",
            "train.packages", "train.recall", "train.run_dir", "train.run_status", "train.runs", "train.safety",
            "train.start_checks", "train.tasks", "train.data.prepare", "train.data.prepare_sharded", "train.data.verify")
LAYERS = (
    ("machine", ("nsa.triton_support",), "what this machine's software can run: the Triton the kernels need"),
    ("model config", ("nsa.config", "nsa.profiling"), "model and NSA config dataclasses; profiling ranges"),
    ("building blocks", ("nsa", "nsa.layers", "nsa.loss", "nsa.custom_op"),
     "norms, rotary embedding, MLP; the chunked loss; custom ops called directly in eager mode"),
    ("kernels", ("nsa.attention.kernels",), "Triton kernels and their launchers"),
    ("implementations", ("nsa.attention.impl",), "pure torch implementations of NSA's stages (and FlexAttention)"),
    ("ops", ("nsa.attention.ops",), "the custom ops: the only place that registers ops and chooses a kernel"),
    ("attention modules", ("nsa.attention",), "NSA and dense attention layers, compressor, decode, caches, gate statistics"),
    ("model", ("nsa.model",), "the Transformer"),
    ("model tools", ("nsa.generate", "nsa.static_decode", "nsa.flops", "nsa.launch_count", "nsa.gate_health"),
     "generation, graphed decoding, FLOP counts, launch counting, gate health over a model"),
    ("trainer foundation", ("train", "train.core"), "errors, environment, run config, artefact names, distributed set-up"),
    ("data", ("train.data",), "tokenizers, sources, packing, prepared token files, batches"),
    ("checkpoints", ("train.checkpoint",), "checkpoint files, state dicts, the out_dir's lineage and lock, TrainState"),
    ("observation", ("train.observe",), "telemetry, sinks, summary, alerts, run status, W&B, profiler, efficiency"),
    ("planning", ("train.planning",), "memory and run-time estimates from a config"),
    ("services", ("train.evaluation", "train.generation", "train.hf", "train.analysis"),
     "scoring a split, text generation, the Hugging Face bridge, run analysis and the twin report"),
    ("trainer", ("train.trainer",), "the training run: build, loop, hooks, stop, safety, optimizer"),
    ("workflows", ("train.workflows",), "the operator's workflows: preflight, postrun, handoff, twin comparison"),
    ("commands", COMMANDS, "one thin module per command line: parse arguments, call the library"),
)


def modules() -> dict[str, Path]:
    """Module name -> file, for every .py of nsa/ and train/."""
    found = {}
    for package in ("nsa", "train"):
        for path in (REPO / package).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of nsa/ and train/ that `name` imports anywhere in its source."""
    out = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parts + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def entry_of(module: str) -> tuple[int, str]:
    """(layer index, entry) of a module: the longest entry that is the module or a package above it."""
    best = None
    for index, (_, entries, _) in enumerate(LAYERS):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (index, entry)
    if best is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_goes_down_or_stays_home(graph):
    wrong = []
    for module, targets in sorted(graph.items()):
        layer, entry = entry_of(module)
        for target in sorted(targets):
            t_layer, t_entry = entry_of(target)
            if t_layer > layer:
                wrong.append(f"{module} ({LAYERS[layer][0]}) imports {target} ({LAYERS[t_layer][0]}): up the order")
            elif t_layer == layer and t_entry != entry:
                wrong.append(f"{module} imports {target}: siblings {entry} and {t_entry} of {LAYERS[layer][0]!r}")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles(graph):
    cycles, state, stack = [], {}, []

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)


def test_the_top_of_train_holds_only_commands():
    top = {name for name in modules() if name.count(".") == 1 and name.startswith("train.")
           and not (REPO / name.replace(".", "/")).is_dir()}
    assert top == {c for c in COMMANDS if c.count(".") == 1}, "train/*.py are commands; a library module goes in a subpackage"
    for command in COMMANDS:
        tree = ast.parse(modules()[command].read_text(encoding="utf-8"))
        assert any(isinstance(n, ast.FunctionDef) and n.name in ("main", "cli") for n in tree.body), command


def test_every_declared_entry_exists():
    known = modules()
    for _, entries, _ in LAYERS:
        for entry in entries:
            assert entry in known, f"LAYERS names {entry}, which is no module of nsa/ or train/"


def test_architecture_doc_shows_the_order():
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    positions = []
    for layer, entries, _ in LAYERS:
        match = re.search(rf"^\|\s*{re.escape(layer)}\s*\|", doc, re.MULTILINE)
        assert match, f"docs/ARCHITECTURE.md has no table row for the layer {layer!r}"
        row = doc[match.start(): doc.index("\n", match.start())]
        for entry in entries:
            if entry not in COMMANDS:
                assert f"`{entry}`" in row, f"docs/ARCHITECTURE.md: the {layer!r} row does not name `{entry}`"
        positions.append(match.start())
    assert positions == sorted(positions), "docs/ARCHITECTURE.md lists the layers in another order than LAYERS"
