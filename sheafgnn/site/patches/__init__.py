"""The patch types of the site, one file each: the registry that the schema, build_site and SiteStream read.

A patch type is a module ``sheafgnn/site/patches/<name>.py`` that defines
``RULE``, an instance of a :class:`~sheafgnn.site.patches.rule.PatchRule`
subclass. The rule declares:

- its **schema roles** (class attributes): ``covered`` (its patches pool the
  tokens they span), ``chained`` (each follows an earlier one of its type,
  :meth:`~PatchRule.chain_lag` back), ``anchors`` / ``anchored``, ``read`` (the
  outputs read its latest :meth:`~PatchRule.read_count` patches), ``links`` (the
  link edge types it makes), ``attribute`` (a per-node id the model embeds,
  :meth:`~PatchRule.attribute_rows` values), ``on_by_default``, ``always_on``;
- its **config fields**: ``config_fields``, a dataclass whose fields are named for
  the type (``local_window``); :class:`~sheafgnn.site.SiteConfig` is built from
  every type's, so they are flat keys of it (``site.local_window`` in YAML), and
  :func:`~sheafgnn.site.patches.rule.integer` fields are checked;
- its **vectorised spans** (:meth:`~PatchRule.spans`): the patches of a whole
  :class:`~sheafgnn.site.patches.rule.Window` with tensor ops, for build_site;
- its **incremental scanner** (:meth:`~PatchRule.scanner`): one per stream, whose
  ``push(chunk)`` returns the patches that closed in one push, for SiteStream.

How they are used:

- :mod:`sheafgnn.site.schema` derives the node types, the role tables
  (``COVERED_TYPES``, ``CHAINED_TYPES``, ...), the edge families and their order
  (``EDGE_TYPES``, ``GLUE_EDGES``: the model's edge-type ids) and ``SiteConfig``
  from :data:`RULES`, in its order;
- :func:`~sheafgnn.site.build_site` calls ``spans`` of every switched-on type, and
  :class:`~sheafgnn.site.SiteStream` ``push`` of each switched-on type's scanner
  (a loop over those types per push, nothing more); both add the structural
  edges (cover, chain, anchor, read) from the roles (:mod:`sheafgnn.site.edges`);
- the model embeds every type's ``attribute`` (:class:`~sheafgnn.model.SheafStateLM`).

To add a type, add its file (and its tests): nothing else changes
(``tests/patch_types/line.py`` is a small example, which tests/test_layout.py
adds to a copy of the package). The order of the nine built-in types is fixed
(:data:`BUILT_IN`): the node types, and so the model's type embeddings and
edge-type ids, follow it, and saved checkpoints index them. A new file's type
comes after them, by name, and before ``output``, whose nodes (the readout)
come last. It is in the schema whether switched on or not, so it adds rows to
the model's tables: a checkpoint saved without it does not load with it.
"""

from __future__ import annotations

import importlib
import pkgutil

from sheafgnn.site.patches.rule import PatchRule

BUILT_IN = ("local", "sentence", "syntax", "instruction", "topic", "memory", "retrieval", "workspace")
LAST = "output"


def _discover() -> dict[str, PatchRule]:
    """Every module of this package that defines ``RULE``, by type name, in type order."""
    found = {}
    for module in pkgutil.iter_modules(__path__):
        rule = getattr(importlib.import_module(f"{__name__}.{module.name}"), "RULE", None)
        if rule is None:
            continue
        if not isinstance(rule, PatchRule) or rule.name != module.name:
            raise TypeError(f"sheafgnn.site.patches.{module.name}: RULE must be a PatchRule named "
                            f"{module.name!r} (got {rule!r})")
        found[rule.name] = rule
    added = sorted(set(found) - set(BUILT_IN) - {LAST})
    return {name: found[name] for name in (*BUILT_IN, *added, LAST) if name in found}


RULES: dict[str, PatchRule] = _discover()  # every patch type, in node-type order

__all__ = ["BUILT_IN", "RULES", "PatchRule"]
