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
        help="list available passes and presets",
        description="List every pass (name, family, one-line doc, the plugin it comes from, its options) and "
        "every preset with what it expands to.",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> CommandResult:
    from mograph.api import list_passes
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
    return CommandResult(data={"passes": passes, "presets": presets}, text="\n".join(lines))
