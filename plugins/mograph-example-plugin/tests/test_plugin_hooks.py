"""The plugin registers through mograph's hooks like a built-in: its pass, its preset, its name."""

from __future__ import annotations

import mograph_example_plugin

from mograph.plugins import Registry, get_plugin_manager


def _registry() -> Registry:
    pm = get_plugin_manager(autoload=False)  # built-ins only; then this plugin, under its entry-point name
    if pm.get_plugin("example") is None:
        pm.register(mograph_example_plugin, name="example")
    return Registry.build(pm)


def test_pass_and_preset_are_registered_under_the_plugin_name():
    reg = _registry()
    assert reg.passes["remove-double-transpose"] is mograph_example_plugin.RemoveDoubleTransposePass
    assert reg.pass_source["remove-double-transpose"] == "example"
    assert reg.preset_source["simplify-transposes"] == "example"
    assert reg.expand("simplify-transposes") == ["remove-double-transpose", "eliminate-dead", "topo-sort"]


def test_option_is_declared_for_the_command_line():
    options = _registry().all_options()
    opt, owners = options["transpose_merge"]
    assert owners == ["remove-double-transpose"]
    assert opt.default is True
