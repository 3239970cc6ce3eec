"""``mograph passes``: list every available pass and preset, and where each comes from."""

from __future__ import annotations

import argparse
from typing import Any

from mograph.cli import CommandResult

__all__ = ["add_parser", "run"]


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "passes",
        parents=[common],
        help="list available passes, presets, custom ops and backends",
        description="List every pass (name, family, one-line doc, the plugin it comes from, its options), "
        "every preset with what it expands to, every custom op (with the targets it lowers to) and every "
        "backend (whether it can run here, and whether it builds artifacts), each with the plugin it comes from.",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.api import list_passes
    from mograph.backends import backend_target, is_available, why_unavailable
    from mograph.plugins import get_registry

    passes = list_passes(blocked=args.block_plugin)
    reg = get_registry(args.block_plugin)
    presets = {
        name: {"expands_to": reg.expand([name]), "plugin": reg.preset_source[name]} for name in sorted(reg.presets)
    }
    lines = ["passes:"]
    width = max((len(p["name"]) for p in passes), default=10)
    for p in passes:
        lines.append(f"  {p['name']:<{width}}  {p['summary']}  [{p['plugin']}]")
        for o in p["options"]:
            lines.append(f"  {'':<{width}}    --{o['name']}: {o['help']} (default: {o['default']})")
    lines.append("presets:")
    for name, info in presets.items():
        lines.append(f"  {name:<{width}}  {','.join(info['expands_to'])}  [{info['plugin']}]")
    custom_ops: dict[str, dict[str, Any]] = {
        f"{op.domain}.{op.name}": {"version": op.version, "lowers_to": sorted(op.lowerings), "doc": op.doc}
        for _key, op in sorted(reg.custom_ops.items())
    }
    lines.append("custom ops:")
    opw = max((len(n) for n in custom_ops), default=10)
    for name, info in custom_ops.items():
        lines.append(f"  {name:<{opw}}  lowers to: {', '.join(info['lowers_to']) or '-'}")
    backends: dict[str, dict[str, Any]] = {}
    for name in sorted(reg.backends):
        backend = reg.backends[name]
        ready = is_available(backend)
        backends[name] = {
            "plugin": reg.backend_source[name],
            "description": getattr(backend, "description", "") or "",
            "target": backend_target(backend),
            "available": ready,
            "why_unavailable": None if ready else why_unavailable(backend),
            "builds": callable(getattr(backend, "build", None)),
        }
    lines.append("backends:")
    for name, info in backends.items():
        state = "available" if info["available"] else f"not available: {info['why_unavailable']}"
        builds = ", builds artifacts" if info["builds"] else ""
        lines.append(f"  {name:<{width}}  {info['description']} ({state}{builds})  [{info['plugin']}]")
    data = {"passes": passes, "presets": presets, "custom_ops": custom_ops, "backends": backends}
    return CommandResult(data=data, text="\n".join(lines))
