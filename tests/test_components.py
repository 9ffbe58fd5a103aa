"""The ablation's parts: each change switches its part the other way, whichever way the default goes."""

import pytest

from sheafgnn.experiments.components import component_changes, without_patch_type
from sheafgnn.model import SheafStateConfig


@pytest.mark.parametrize("name, part, field", [("qk_norm", "topology", "qk_norm"),
                                               ("gate_init", "gluing", "gate_init")])
def test_a_two_way_part_is_switched_to_the_other_way(name, part, field):
    default = SheafStateConfig()
    changed = SheafStateConfig.from_dict({part: component_changes(default)[name][part]})
    assert getattr(getattr(changed, part), field) != getattr(getattr(default, part), field)
    switched_back = component_changes(changed)[name][part][field]
    assert switched_back == getattr(getattr(default, part), field)


def test_every_change_is_a_valid_config():
    for change in component_changes().values():
        SheafStateConfig.from_dict(change)  # raises on an unknown field or a wrong type


def test_without_patch_type():
    assert without_patch_type(["local", "workspace", "output"], "local") == {"patch_types": ["workspace", "output"]}
    with pytest.raises(ValueError, match="not one of"):
        without_patch_type(["local", "output"], "sentence")
