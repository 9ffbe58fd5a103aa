"""The flat keys of :class:`~sheafgnn.model.SheafStateConfig` before it was nested into groups.

They still load, with a deprecation warning naming each key's new place, so configs and checkpoints written
before keep working (:meth:`SheafStateConfig.nested <sheafgnn.model.SheafStateConfig.nested>`).
"""

from __future__ import annotations

# key -> (group, field)
FLAT_KEYS = {
    "stalk_dim": ("gluing", "stalk_dim"), "map_kind": ("gluing", "map_kind"), "glue_gate": ("gluing", "gate"),
    "d_state": ("ssm", "d_state"), "expand": ("ssm", "expand"), "headdim": ("ssm", "headdim"),
    "chunk_size": ("ssm", "chunk_size"), "recompute_ssm": ("ssm", "recompute"), "shared_ssm": ("ssm", "shared"),
    "expert_mult": ("experts", "mult"), "num_experts": ("experts", "num_experts"),
    "shared_experts": ("experts", "shared"), "balance_weight": ("experts", "balance_weight"),
    "topology_k": ("topology", "k"), "topology_rank": ("topology", "rank"),
    "content_blocks": ("topology", "content_blocks"), "proposal_block": ("topology", "block_size"),
    "random_proposals": ("topology", "random_proposals"), "block_summary": ("topology", "block_summary"),
    "block_scorer": ("topology", "block_scorer"), "block_loss_weight": ("topology", "block_loss_weight"),
    "sink_threshold": ("topology", "sink_threshold"), "pool_loss_weight": ("topology", "pool_loss_weight"),
    "keep_cost": ("topology", "keep_cost"),
}


# Defaults of the flat layout that the nested one changed: they fill a flat (earlier) config where it is silent.
FLAT_DEFAULTS = {"gluing": {"mode": "outputs", "projections": True, "map_init": "random"}, "ssm": {"shared": False},
                 "experts": {"shared": False}, "topology": {"content_blocks": 2, "block_size": 16,
                                                            "block_summary": "mean",
                                                            "random_proposals": 4}}


def nest_flat_keys(values: dict) -> tuple[dict, list[str]]:
    """``values`` with the flat keys of :data:`FLAT_KEYS` (and ``gluing: bool``, ``token_residual``,
    ``tune_cpu_allocator``) moved to their groups; returns the nested values and what was moved, for the message."""
    out, moved, mode = dict(values), [], None
    if isinstance(out.get("gluing"), bool) or "token_residual" in out:  # gluing was a switch, token_residual a mode
        on = out.pop("gluing") if isinstance(out.get("gluing"), bool) else True
        residual = out.pop("token_residual", False)
        mode = "off" if not on else "tokens" if residual else "outputs"
        moved.append(f"gluing / token_residual -> gluing.mode: {mode}")
    for key in [k for k in out if k in FLAT_KEYS]:
        group, name = FLAT_KEYS[key]
        out[group] = {**out.get(group, {}), name: out.pop(key)}
        moved.append(f"{key} -> {group}.{name}")
    if mode is not None:
        out["gluing"] = {**out.get("gluing", {}), "mode": mode}
    if "tune_cpu_allocator" in out:
        out.pop("tune_cpu_allocator")
        moved.append("tune_cpu_allocator: dropped (call sheafgnn.tune_cpu(): a model no longer changes process "
                     "settings)")
    return out, moved
