"""50 JSON schemas of increasing complexity, each with one instance valid against it.

``SCHEMAS[k]`` (k = 0..49) grows with k: flat objects of a few primitives, then enums,
bounded numbers and optional fields, arrays of primitives and of objects, nested objects,
``anyOf`` / ``$defs`` + ``$ref`` / ``const`` / string patterns, and at the top objects of a
few dozen fields nesting all of those. Deterministic (seeded by k), so runs compare.

Each instance lists properties in the schema's order (the order constrained decoders emit
them in) and is what ``bench/grammar.py libs`` feeds through each library's matcher, token
by token, to time the per-token mask on the same path for every library; the engine
scenario (``bench/grammar.py engine``) uses the schemas alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

__all__ = ["SCHEMAS", "SchemaCase", "schema_case"]

_WORDS = ["city", "name", "price", "count", "tags", "owner", "status", "score", "label", "kind",
          "color", "size", "unit", "note", "level", "rank", "title", "email", "date", "code"]
_ENUMS = [["red", "green", "blue"], ["low", "medium", "high"], ["open", "closed"], ["celsius", "fahrenheit"],
          ["draft", "review", "published", "archived"]]


@dataclass(frozen=True, slots=True)
class SchemaCase:
    index: int
    name: str
    schema: dict
    instance: Any


class _Builder:
    """Builds a (schema, instance) pair of a given complexity."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.rng = random.Random(1000 + k)
        self.defs: dict[str, dict] = {}
        self.def_instances: dict[str, Any] = {}

    def primitive(self, level: int) -> tuple[dict, Any]:
        r = self.rng
        choices = ["string", "integer", "boolean"]
        if level >= 1:
            choices += ["number", "enum", "bounded"]
        if level >= 3:
            choices += ["pattern", "const", "nullable"]
        kind = r.choice(choices)
        if kind == "string":
            return {"type": "string"}, r.choice(["Paris", "a short note", "blue whale", "ok"])
        if kind == "integer":
            return {"type": "integer"}, r.randint(0, 999)
        if kind == "boolean":
            return {"type": "boolean"}, r.choice([True, False])
        if kind == "number":
            return {"type": "number"}, round(r.uniform(-50, 50), 2)
        if kind == "enum":
            values = r.choice(_ENUMS)
            return {"type": "string", "enum": values}, r.choice(values)
        if kind == "bounded":
            return {"type": "integer", "minimum": 1, "maximum": 100}, r.randint(1, 100)
        if kind == "pattern":
            return {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "ABC-1234"
        if kind == "const":
            return {"const": "v1"}, "v1"
        return {"anyOf": [{"type": "string"}, {"type": "null"}]}, None

    def value(self, level: int, depth: int) -> tuple[dict, Any]:
        r = self.rng
        if depth <= 0 or level < 2:
            return self.primitive(level)
        kinds = ["primitive", "primitive", "array"]
        if level >= 3:
            kinds += ["object", "array_of_objects"]
        if level >= 4:
            kinds += ["ref", "any_of"]
        kind = r.choice(kinds)
        if kind == "primitive":
            return self.primitive(level)
        if kind == "array":
            item, _ = self.primitive(min(level, 1))
            n = r.randint(1, 3)
            items = [self.primitive_instance(item) for _ in range(n)]
            return {"type": "array", "items": item, "minItems": 1, "maxItems": 4}, items
        if kind == "object":
            return self.obj(level, depth - 1, r.randint(2, 4))
        if kind == "array_of_objects":
            item_schema, first = self.obj(level, depth - 1, r.randint(2, 3))
            return {"type": "array", "items": item_schema, "minItems": 1, "maxItems": 3}, [first]
        if kind == "ref":
            name = f"Item{len(self.defs)}"
            schema, instance = self.obj(level - 1, depth - 1, r.randint(2, 3))
            self.defs[name] = schema
            return {"$ref": f"#/$defs/{name}"}, instance
        first, first_instance = self.primitive(1)
        second, _ = self.obj(2, 0, 2)
        return {"anyOf": [first, second]}, first_instance

    def primitive_instance(self, schema: dict) -> Any:
        r = self.rng
        if "enum" in schema:
            return r.choice(schema["enum"])
        kind = schema.get("type")
        if kind == "string":
            return r.choice(["alpha", "beta", "gamma"])
        if kind == "integer":
            return r.randint(schema.get("minimum", 0), schema.get("maximum", 99))
        if kind == "number":
            return round(r.uniform(0, 10), 1)
        return r.choice([True, False])

    def obj(self, level: int, depth: int, n: int) -> tuple[dict, Any]:
        r = self.rng
        names = r.sample(_WORDS, min(n, len(_WORDS)))
        properties: dict[str, dict] = {}
        instance: dict[str, Any] = {}
        required: list[str] = []
        for name in names:
            schema, value = self.value(level, depth)
            properties[name] = schema
            optional = level >= 1 and r.random() < 0.25
            if not optional:
                required.append(name)
                instance[name] = value
            elif r.random() < 0.5:
                instance[name] = value
        # the instance keeps the schema's property order
        instance = {name: instance[name] for name in properties if name in instance}
        schema = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
        return schema, instance


def schema_case(k: int) -> SchemaCase:
    """The k-th schema (0 = simplest, 49 = the most complex) and a valid instance."""
    assert 0 <= k < 50
    level = k // 10  # 0: flat primitives .. 4: refs, anyOf, patterns, big nested objects
    b = _Builder(k)
    n_props = 1 + k % 10 // 2 + level * 2 + (k // 40) * 12
    depth = 0 if level < 2 else 1 + (k % 10) // 4
    schema, instance = b.obj(level, depth, n_props)
    if b.defs:
        schema = {**schema, "$defs": b.defs}
    return SchemaCase(k, f"s{k:02d}-L{level}-p{n_props}-d{depth}", schema, instance)


SCHEMAS: list[SchemaCase] = [schema_case(k) for k in range(50)]
