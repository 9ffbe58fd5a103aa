"""The parts of the sheaf model that an ablation switches, each by the change of its config.

One table for both ablations: ``benchmarks/bench_ablation.py`` trains each variant on text,
``benchmarks/bench_recall.py`` on MQAR, so a part's two verdicts (issue 36: it lowers the loss or it is needed
for recall) are about the same change. Patch types are switched through the site, whose types differ between
text and the tasks; :func:`without_patch_type` gives that change.
"""

from __future__ import annotations

from sheafgnn.model import SheafStateConfig


def component_changes(default: SheafStateConfig | None = None) -> dict[str, dict]:
    """Name -> the partial ``SheafStateConfig`` (nested dicts) that switches one part of ``default`` the other way.

    A part that is a choice between two (QK-norm, the key's start, the gate, 4 random proposals or none) is
    switched to the other choice, so the change stays an ablation of the default whichever way the default goes.
    """
    default = default or SheafStateConfig()
    topology, gluing = default.topology, default.gluing
    return {"no_content_proposals": {"topology": {"content_blocks": 0}},
            "random_proposals": {"topology": {"random_proposals": 0 if topology.random_proposals else 4}},
            "qk_norm": {"topology": {"qk_norm": not topology.qk_norm}},
            "identity_maps": {"gluing": {"map_kind": "identity"}},
            "orthogonal_maps": {"gluing": {"map_kind": "orthogonal"}},
            "general_maps": {"gluing": {"map_kind": "general"}},
            "map_init": {"gluing": {"map_init": "random" if gluing.map_init == "identity" else "identity"}},
            "headdim_8": {"ssm": {"headdim": 8}},
            "headdim_16": {"ssm": {"headdim": 16}},
            "separate_patch_ssm": {"ssm": {"shared": not default.ssm.shared}},
            "experts_per_type": {"experts": {"shared": not default.experts.shared}},
            "gluing_into_outputs": {"gluing": {"mode": "outputs", "projections": True}},
            "pool_loss": {"topology": {"pool_loss_weight": 0.0 if topology.pool_loss_weight else 1.0}},
            "explore": {"topology": {"explore": 0.0 if topology.explore else 1.0}},
            "projections": {"gluing": {"projections": not gluing.projections}},
            "key_previous_init": {"topology": {"key_previous_init": "random" if topology.key_previous_init
                                               == "query" else "query"}},
            "rezero_gate": {"gluing": {"gate_init": 0.0, "gate_scale": 1.0} if gluing.gate_init
                            else {"gate_init": 0.1, "gate_scale": 10.0}},
            # the broadcast gate's start the other way, 1 <-> 0.1 (`open_gate` while the default started it at
            # 0.1): from 1 the gathered answer reaches the readout at full strength from step 0, and the scattered
            # layout's seed 1 passes only so (docs/results.md#the-gate-from-1-the-default)
            "gate_init": {"gluing": {"gate_init": 0.1 if gluing.gate_init >= 1.0 else 1.0}}}


def without_patch_type(patch_types: list[str], patch_type: str) -> dict:
    """The site change that drops ``patch_type`` (its nodes and every edge touching them) from ``patch_types``."""
    if patch_type not in patch_types:
        raise ValueError(f"patch type {patch_type!r} is not one of {patch_types}")
    return {"patch_types": [p for p in patch_types if p != patch_type]}
