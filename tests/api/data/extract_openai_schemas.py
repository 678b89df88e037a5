"""Cut the response schemas Strata's tests validate against out of OpenAI's OpenAPI spec.

OpenAI's published spec (github.com/openai/openai-openapi, openapi.yaml) is 3 MB of YAML; the
tests need only the responses Strata answers and what they reference. Run:

    python tests/api/data/extract_openai_schemas.py PATH/TO/openapi.yaml COMMIT

which rewrites tests/api/data/openai_schemas.json (public data, kept verbatim).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

ROOTS = ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse",
         "CreateCompletionResponse", "ListModelsResponse", "Model", "Response",
         "ResponseStreamEvent")
OUT = Path(__file__).with_name("openai_schemas.json")


def _refs(node: object) -> set[str]:
    if isinstance(node, dict):
        found = set()
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            found.add(ref.rsplit("/", 1)[1])
        for value in node.values():
            found |= _refs(value)
        return found
    if isinstance(node, list):
        return set().union(*(_refs(v) for v in node)) if node else set()
    return set()


def main(spec_path: str, commit: str) -> None:
    schemas = yaml.load(Path(spec_path).read_text(), Loader=yaml.CSafeLoader)[
        "components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            todo.extend(_refs(schemas[name]) - keep)
    OUT.write_text(json.dumps({
        "source": f"github.com/openai/openai-openapi openapi.yaml at {commit}",
        "components": {"schemas": {name: schemas[name] for name in sorted(keep)}}},
        indent=1, sort_keys=True) + "\n")
    print(f"{len(keep)} schemas -> {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
