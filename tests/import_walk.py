"""What a msmon source file imports, read from its text: the layering tests' one reader.

Every import counts: function-level ones (they run when the function does) and those inside an
`if TYPE_CHECKING:` block (they never run, but a circle that only annotations close is still a
circle to a reader: .importlinter counts them too). `from a import b` gives `a.b` (the module
`a.b` where it is one, else the name `b` of `a`: `module_of` tells which)."""

from __future__ import annotations

import ast
from pathlib import Path

import msmon

PACKAGE = Path(msmon.__file__).parent


def module_name(path: Path) -> str:
    """`msmon.runtime.step` for src/msmon/runtime/step.py, `msmon.hooks` for its __init__.py."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def msmon_imports(path: Path) -> set[str]:
    """The msmon names the file at `path` imports."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "msmon"}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "msmon":
                found |= {f"{target}.{alias.name}" for alias in node.names}
    return found


def module_of(name: str, modules: set[str] | dict[str, Path]) -> str:
    """The module `name` (an imported name, `a.b.c`) lives in: itself, or its longest prefix
    that is one of `modules`."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name
