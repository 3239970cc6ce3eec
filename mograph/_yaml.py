"""YAML read from a user's file, bounded before use: size, aliases, and what an error may show.

Why: ``yaml.safe_load`` builds no objects, but YAML aliases share a node, so a 1 KB file of nested
aliases (a "billion laughs") stands for billions of values.  Loading it is cheap; anything that then
walks the value (a check, ``str()``, ``repr()`` in an error message, writing it back) expands it and
grows memory without bound.  So a sweep config and a precision plan are read with
:func:`load_yaml_file`:

* the file is at most ``max_bytes`` (checked on its size before reading) and is UTF-8 text (a binary
  file is a clean error);
* the document is composed into YAML nodes (aliases still shared), its *expanded* size is counted
  (each alias counts the full size of what it names; a cycle is refused), and a document whose expanded
  size passes :data:`MAX_EXPANSION` times its own node count (plus a small allowance) is refused before
  any Python value is built;
* every error is one line that names the file and never prints the document's values.

Every failure raises ``error`` (a :class:`~mograph.errors.UsageError` subclass: exit 2).  :func:`shown`
is the helper error messages use to show a value: ``repr`` cut to a few dozen characters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mograph.errors import UsageError

__all__ = ["load_yaml_file", "shown", "MAX_BYTES", "MAX_EXPANSION"]

#: Largest YAML file read (a plan for a model with a hundred thousand nodes is a few MB).
MAX_BYTES = 64 * 2**20
#: Largest ratio of a document's expanded node count to its written node count (plus 10 000 nodes):
#: an anchor reused a few times passes; nested aliases (exponential growth) do not.
MAX_EXPANSION = 10


def shown(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message (never a whole expanded value)."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 8:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _expanded_size(root: Any, budget: int, where: str, error: type[UsageError]) -> int:
    """Nodes of the document under ``root`` with every alias expanded; refuse past ``budget`` or on a cycle."""
    import yaml

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise error(f"{where}: a YAML alias refers to itself (a cycle); refused")
        active.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            for child in node.value:
                total += size(child)
                if total > budget:
                    break
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k) + size(v)
                if total > budget:
                    break
        active.discard(key)
        if total > budget:
            raise error(
                f"{where}: the YAML expands to more than {budget} values through its aliases (&anchor / *alias); "
                "refused before use"
            )
        sizes[key] = total
        return total

    return size(root)


def _count_nodes(root: Any) -> int:
    """Distinct nodes of the composed document (what was written; aliases count once)."""
    import yaml

    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.extend((k, v))
    return len(seen)


def load_yaml_file(
    path: str | os.PathLike[str], what: str, error: type[UsageError] = UsageError, *, max_bytes: int = MAX_BYTES
) -> Any:
    """The value of the YAML (or JSON) file ``path``, bounded as the module docstring says; ``what`` names
    the option in errors (``--config``, ``--precision-plan``)."""
    import yaml

    p = Path(path)
    where = f"{what} {p}"
    if not p.is_file():
        raise error(f"{where}: no such file")
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    if size > max_bytes:
        raise error(f"{where}: {size} bytes, more than the {max_bytes} a YAML file may have here")
    try:
        raw = p.read_bytes()[: max_bytes + 1]
    except OSError as exc:
        raise error(f"{where}: cannot read it ({exc.strerror or exc})") from exc
    if b"\x00" in raw:
        raise error(f"{where}: a binary file, not YAML text")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte {exc.start}), not YAML") from exc
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
            if root is None:
                return None
            written = _count_nodes(root)
            _expanded_size(root, MAX_EXPANSION * written + 10_000, where, error)
            return loader.construct_document(root)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise error(f"{where}: not valid YAML ({first[:200]})") from exc
    except RecursionError as exc:
        raise error(f"{where}: the YAML nests too deeply") from exc
