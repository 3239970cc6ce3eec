"""``python -m mograph`` runs the command line."""

from mograph.cli import entry

entry()
