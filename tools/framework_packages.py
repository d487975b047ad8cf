"""No framework package imports another (`make lint`).

Each sub-package of msmon.hooks is one framework (seams/registry.py finds them by that rule), and
everything msmon knows about a framework lives in its folder; what they share sits beside them
(hooks/handover.py, hooks/attach.py) or below them (seams/). So a module inside one framework
package never imports a module of a sibling package, not even under `if TYPE_CHECKING:`. Prints
each such import; exit status 1 when any.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import grimp


def framework_packages(parent: str) -> list[str]:
    """The sub-packages of `parent`, as the framework registry lists them."""
    module = importlib.import_module(parent)
    return sorted(f"{parent}.{found.name}" for found in pkgutil.iter_modules(module.__path__) if found.ispkg)


def sibling_imports(parent: str) -> list[tuple[str, str]]:
    """(importer, imported) for every import from one framework package into another."""
    graph = grimp.build_graph(parent.split(".")[0], exclude_type_checking_imports=False)
    packages = framework_packages(parent)

    def package_of(module: str) -> str | None:
        return next((p for p in packages if module == p or module.startswith(p + ".")), None)

    found = []
    for package in packages:
        for module in sorted({package} | graph.find_descendants(package)):
            for imported in sorted(graph.find_modules_directly_imported_by(module)):
                other = package_of(imported)
                if other is not None and other != package:
                    found.append((module, imported))
    return found


def main(parent: str = "msmon.hooks") -> int:
    found = sibling_imports(parent)
    for importer, imported in found:
        print(f"framework package imports a sibling: {importer} -> {imported}")
    if not found:
        print(f"no framework package of {parent} imports another ({len(framework_packages(parent))} packages)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
