"""The package's layers (docs/design.md, "Layers"): imports run one way, with no cycle.

Every `import` and `from ... import` of an `opd_jax` module counts, those inside functions
too (a function-level import is still a dependency; it only hides it from a reader). The
layers, bottom to top, are the subpackages in `LAYERS`; the top-level modules are the
commands and the public `opd_jax.budget` facade, and `bench/` sits above them.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "opd_jax"
LAYERS = (
  "config",
  "model",
  "io",
  "data",
  "inference",
  "rollout",
  "train",
  "mismatch",
  "experiments",
  "cli",
)
TOP = len(LAYERS)  # opd_jax/<command>.py
BENCH = TOP + 1  # opd_jax/bench/


def _load_tool(name):
  path = PACKAGE.parent / "tools" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"_tools_{name}", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


reach = _load_tool("config_reach")
# The one module below the trainer that reads the ConfigDict: the schema it is validated against.
CONFIG_SCHEMA = "opd_jax.config.check"


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
  """The rank of `module` (an `opd_jax.` dotted name): higher layers may import lower ones."""
  parts = module.split(".")
  if len(parts) == 1:
    return -1  # the package itself: empty
  if parts[1] == "bench":
    return BENCH
  if parts[1] in LAYERS:
    return LAYERS.index(parts[1])
  return TOP


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
  """The `opd_jax` modules `path` imports, anywhere in the file."""
  me = module_name(path)
  package = me if path.name == "__init__.py" else me.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("opd_jax")}
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ""
      if not source.startswith("opd_jax"):
        continue
      for alias in node.names:  # `from pkg import module` names a module; else the source
        found.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in known else source)
  return found - {me}


def import_graph() -> dict[str, set[str]]:
  paths = sorted(PACKAGE.rglob("*.py"))
  known = {module_name(p) for p in paths}
  return {module_name(p): imports(p, known) for p in paths}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def upward(graph: dict[str, set[str]]) -> list[str]:
  return sorted(
    f"{src} ({LAYER_NAME(layer(src))}) -> {dst} ({LAYER_NAME(layer(dst))})"
    for src, targets in graph.items()
    for dst in targets
    if layer(dst) > layer(src)
  )


def LAYER_NAME(rank: int) -> str:  # noqa: N802 - reads as a table lookup
  return {TOP: "commands", BENCH: "bench", -1: "package"}.get(rank) or LAYERS[rank]


def test_every_module_is_in_a_layer():
  graph = import_graph()
  stray = [m for m in graph if layer(m) == TOP and m.count(".") > 1]
  assert not stray, f"modules outside the layers: {stray}"


def test_no_import_cycle():
  found = cycles(import_graph())
  print(f"{len(found)} cycles")
  assert not found, f"import cycles: {found}"


def test_no_import_runs_up_a_layer():
  found = upward(import_graph())
  print(f"{len(found)} upward imports")
  assert not found, "imports that run from a lower layer to a higher one:\n" + "\n".join(found)


def test_the_checks_catch_what_they_look_for():
  """The graph checks on a made-up graph: a cycle and an upward import are found."""
  graph = {"opd_jax.model.a": {"opd_jax.train.b"}, "opd_jax.train.b": {"opd_jax.model.a"}}
  assert cycles(graph) == [["opd_jax.model.a", "opd_jax.train.b"]]
  assert upward(graph) == ["opd_jax.model.a (model) -> opd_jax.train.b (train)"]
  assert layer("opd_jax.main") == TOP and layer("opd_jax.bench.sampler") == BENCH


def below_trainer_config_uses(paths) -> list[str]:
  """Modules below `train/` that take the ConfigDict: import ml_collections, or have a function
  with a parameter named `config` or annotated ConfigDict (`tools/config_reach.py`)."""
  return [
    f"{module_name(p)}: {use}"
    for p in paths
    if layer(module_name(p)) < LAYERS.index("train") and module_name(p) != CONFIG_SCHEMA
    for use in reach.config_uses(p)
  ]


def test_no_config_dict_below_the_trainer():
  """Below `train/` the run spec travels (`config.spec.RunSpec`), never the ConfigDict; a
  parameter that takes a spec is named for it (`spec`, `rollout`, ...), not `config`."""
  found = below_trainer_config_uses(sorted(PACKAGE.rglob("*.py")))
  assert not found, "the ConfigDict below the trainer:\n" + "\n".join(found)


def test_the_config_check_catches_what_it_looks_for(tmp_path):
  """A made-up io module that imports ml_collections and takes `config` is caught twice; one
  that takes a spec is not."""
  bad = PACKAGE / "io" / "_made_up.py"  # a path inside the package, never written
  source = "import ml_collections\ndef build(config: ml_collections.ConfigDict):\n  pass\n"
  (tmp_path / "bad.py").write_text(source)
  (tmp_path / "good.py").write_text("def build(spec):\n  return spec.seed\n")
  assert reach.config_uses(tmp_path / "bad.py") == ["imports ml_collections", "build(config)"]
  assert reach.config_uses(tmp_path / "good.py") == []
  assert layer(module_name(bad)) < LAYERS.index("train")
