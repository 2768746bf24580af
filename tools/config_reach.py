"""Counts where the raw run config (an `ml_collections.ConfigDict`) reaches in the package.

    python tools/config_reach.py [PACKAGE_DIR] [--files]

A function takes the ConfigDict when it has a parameter named `config` or annotated with
`ConfigDict`; a file is reached when one of its functions takes it or when it imports
`ml_collections` (to build, copy or check one). Prints the files reached, and the functions
that take it per layer (the package's subfolders; top-level modules are "commands").
`--files` lists the files reached.
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib


def takes_config(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
  """Has `fn` a parameter named `config` or annotated `...ConfigDict`?"""
  a = fn.args
  for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
    if arg.arg == "config" or annotation.endswith("ConfigDict"):
      return True
  return False


def imports_ml_collections(tree: ast.AST) -> bool:
  """Whether `tree` imports ml_collections' ConfigDict side; its flag-text parsers
  (`ml_collections.config_flags`, which `config.values` shares with `--config.key=value`) hold
  no config."""
  for node in ast.walk(tree):
    if isinstance(node, ast.Import) and any(
      a.name.startswith("ml_collections") for a in node.names
    ):
      return True
    module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
    if module.startswith("ml_collections") and not module.startswith("ml_collections.config_flags"):
      return True
  return False


def config_uses(path: pathlib.Path) -> list[str]:
  """What in `path` takes or handles a ConfigDict: "imports ml_collections" and each
  "<function>(config)" (`takes_config`)."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  found = ["imports ml_collections"] if imports_ml_collections(tree) else []
  return found + [
    f"{n.name}(config)"
    for n in ast.walk(tree)
    if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and takes_config(n)
  ]


def reach(package: pathlib.Path) -> tuple[list[str], collections.Counter]:
  """(files reached, relative to `package`; functions taking the config per layer)."""
  files, per_layer = [], collections.Counter()
  for path in sorted(package.rglob("*.py")):
    rel = path.relative_to(package)
    uses = config_uses(path)
    per_layer[rel.parts[0] if len(rel.parts) > 1 else "commands"] += sum(
      u.endswith("(config)") for u in uses
    )
    if uses:
      files.append(str(rel))
  return files, per_layer


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  default = pathlib.Path(__file__).resolve().parent.parent / "opd_jax"
  parser.add_argument("package", nargs="?", default=str(default), help="the opd_jax folder")
  parser.add_argument("--files", action="store_true", help="list the files reached")
  args = parser.parse_args()
  files, per_layer = reach(pathlib.Path(args.package))
  print(f"files reached: {len(files)}")
  layers = ", ".join(f"{k} {v}" for k, v in sorted(per_layer.items()) if v)
  print(f"functions with a config parameter: {sum(per_layer.values())} ({layers})")
  if args.files:
    print("\n".join(files))


if __name__ == "__main__":
  main()
