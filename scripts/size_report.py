"""The size habit as a report, not a gate: modules over 400 lines and functions over 60.

A split is a decision made by responsibility, never by size alone; README's map names each entry
that stays, with its reason.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

MODULE_LINES = 400
FUNCTION_LINES = 60


def long_functions(path: Path) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            length = node.end_lineno - node.lineno + 1
            if length > FUNCTION_LINES:
                found.append((f"{node.name} (line {node.lineno})", length))
    return found


def main(root: Path) -> int:
    modules = []
    functions = []
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > MODULE_LINES:
            modules.append(f"  {path} ({lines} lines)")
        functions += [f"  {path}: {name}: {length} lines" for name, length in long_functions(path)]
    print(
        f"size report: {len(modules)} modules over {MODULE_LINES} lines,"
        f" {len(functions)} functions over {FUNCTION_LINES}"
    )
    for line in modules + functions:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "src")))
