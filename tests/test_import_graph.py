"""The package's structure: no import cycles inside lazy_rag (its kernels and integrations
included, as installed), and one transformer layer loop, which every request goes through."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# installed names of the source folders (pyproject's package-dir)
FOLDERS = {"lazy_rag": ROOT / "lazy_rag", "lazy_rag.kernels": ROOT / "kernels",
           "lazy_rag.integrations": ROOT / "integrations"}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the installed package."""
    out = {}
    for pkg, folder in FOLDERS.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere in its file (a function-level import
    is a dependency too)."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[:len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from p import x`: the submodule p.x if there is one, else the attribute x of p
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        for t in targets:
            # the longest known module that the target names (an attribute import names its module)
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def package_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_the_package_has_no_import_cycles():
    graph = package_graph()
    assert "lazy_rag.engine.engine" in graph and "lazy_rag.kernels.paged_attention" in graph
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_one_transformer_layer_loop():
    """Exactly one loop over a model's decoder layers in the runtime (the engine's forward)."""
    loops = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.For) and any(isinstance(n, ast.Attribute) and n.attr == "layers"
                                                 for n in ast.walk(node.iter)):
                loops.append(name)
    assert loops == ["lazy_rag.engine.model_runner"]


def imported_names(path: Path) -> list[tuple[str, int, str, str]]:
    """(module as written, level, name, kind) of every import in a file: ``from m import name`` and
    ``import m`` (name "")."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            out += [(node.module or "", node.level, a.name, "from") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, 0, "", "import") for a in node.names]
    return out


# the lab: the benchmark harness (lazy_rag.bench), the benchmark scripts and the tests. The
# `lazy-rag bench` command is the harness's one entry point from the runtime.
LAB = ("lazy_rag.bench", "benchmarks", "tests")
LAB_ENTRY_POINTS = {("lazy_rag.cli", "lazy_rag.bench.command")}


def test_the_runtime_imports_nothing_of_the_lab():
    """No module of the installed package (its kernels and integrations included) imports the
    benchmark harness, the benchmark scripts or the tests, at module level or in a function."""
    mods = modules()
    graph = package_graph()
    found = []
    for name, path in mods.items():
        if name.startswith("lazy_rag.bench"):
            continue
        for target in graph[name]:
            if target.startswith(LAB) and (name, target) not in LAB_ENTRY_POINTS:
                found.append(f"{name} imports {target}")
        for module, level, _, _ in imported_names(path):
            if not level and module.split(".")[0] in ("benchmarks", "tests"):
                found.append(f"{name} imports {module}")
    assert found == []


# the index's on-disk format and its users: the KV record, the in-memory chunk KV, the store and
# the writes it makes durable, and the index package
STORE_MODULES = ("lazy_rag.store", "lazy_rag.kv_record", "lazy_rag.chunk_kv", "lazy_rag.file_writes",
                 "lazy_rag.index")


def test_no_private_names_cross_between_the_store_and_its_users():
    """What the store's modules share is public: no module imports a private (``_name``) name from
    one of them, nor do they import one from each other."""
    mods = modules()
    found = []
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        for module, level, imported, kind in imported_names(path):
            if kind != "from" or not imported.startswith("_") or imported.startswith("__"):
                continue
            target = ".".join(base[:len(base) - level + 1] + ([module] if module else [])) if level else module
            if target.startswith(STORE_MODULES) or name.startswith(STORE_MODULES):
                found.append(f"{name} imports {imported} from {target}")
    assert found == []
