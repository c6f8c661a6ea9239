"""Reading a configuration file: YAML with YAML 1.2's booleans, ``${NAME}`` from the
environment, and validation errors told by key and line (``configs/x.yaml:12:
clusters.0.endpoints.0.protocol: Input should be 'http1', 'http2' or 'http3'``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from gateway.core.settings_base import ConfigError

__all__ = ["describe", "line_of", "read_yaml"]


def read_yaml(path: Path) -> tuple[dict, yaml.Node | None]:
    """The file's top-level mapping with ``${NAME}`` expanded, and its node tree (for the
    lines errors name)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return expand(data, path, node, ()), node


_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def expand(value: Any, path: Path, node: yaml.Node | None, loc: tuple) -> Any:
    """``${NAME}`` in any string value replaced by the environment variable ``NAME`` (a
    Redis URL with its password, a key kept in a Kubernetes Secret); ``$${`` is a literal
    ``${``. An unset variable is an error naming the key and its line."""
    if isinstance(value, dict):
        return {k: expand(v, path, node, (*loc, k)) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v, path, node, (*loc, i)) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def variable(match: re.Match) -> str:
        if match.start() > 0 and value[match.start() - 1] == "$":
            return match.group(0)
        name = match.group(1)
        if name not in os.environ:
            line = line_of(node, loc)
            where = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{where}: {'.'.join(map(str, loc))}: the environment variable {name} is not set")
        return os.environ[name]

    return _VARIABLE.sub(variable, value).replace("$${", "${")


class _Loader(yaml.SafeLoader):
    """YAML with YAML 1.2's booleans: only ``true`` and ``false``. PyYAML follows YAML 1.1,
    where unquoted ``off``, ``no``, ``on``, ``yes`` are booleans too, so ``backend: off``
    would arrive as ``False``; here it arrives as the word, and pydantic still reads
    ``enabled: yes`` as a boolean where one is expected."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)



def describe(source: Any, node: yaml.Node | None, exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    deeper = {tuple(e["loc"][:i]) for e in errors for i in range(1, len(e["loc"]))}
    for error in errors:
        if error["type"] == "too_short" and tuple(error["loc"]) in deeper:
            continue  # an item below failed; its own error says why
        loc = ".".join(str(part) for part in error["loc"])
        line = line_of(node, error["loc"])
        where = f"{source}:{line}" if line else str(source)
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        lines.append(f"{where}: {loc or '(top level)'}: {message}")
    return "\n".join(lines)


def line_of(node: yaml.Node | None, loc: tuple[Any, ...]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (or of its nearest existing parent)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if key.value == str(part):
                    line = key.start_mark.line + 1
                    node = value
                    break
            else:
                return line
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line
