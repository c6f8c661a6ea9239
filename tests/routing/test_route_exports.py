import ast
import pathlib

import routing

PKG = pathlib.Path(routing.__file__).parent


def test_all_names_exist():
    for name in routing.__all__:
        assert hasattr(routing, name), name
    assert sorted(routing.__all__) == routing.__all__


def test_routing_imports_no_other_package():
    for path in PKG.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for n in names:
                root = n.split(".")[0]
                assert root not in {"gateway", "cache", "edge_engine", "asyncio", "socket", "time"}, (path.name, n)
