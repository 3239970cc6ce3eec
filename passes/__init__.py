"""mograph's built-in passes, one module per pass, grouped by family.

Each family package (``cleanup``, ``fusion``, ``shape``, ``quant``, ``prune``) is a plugin of its own,
registered by the plugin manager through the same hooks third-party plugins use
(:mod:`mograph.hookspecs`).  This folder is importable as ``mograph.passes``.
"""
