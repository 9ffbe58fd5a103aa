"""One language-model contract for every model the training loop runs.

A model takes a PyG ``Batch`` of sites (from :class:`~sheafgnn.data.WindowDataset`)::

    model(batch)      -> logits (num_tokens, V)   one row per token of every window
    model.loss(batch) -> scalar                   mean cross-entropy over batch['token'].y
    model.config      -> a dataclass              (its fields are saved with checkpoints)

:class:`~sheafgnn.model.SheafStateLM` reads the site graph itself; the
Transformer baselines read only the token ids, through :class:`SequenceLM`.

::

    build_model(kind, options, vocab_size, site)
      sheaf -> SheafStateLM(SheafStateConfig(**options, site=site))
      ssm   -> SheafStateLM(SheafStateConfig(**options, site=site, gluing=False))
      dense -> SequenceLM(CausalTransformer(TransformerConfig(**options, window=None)))
      local -> SequenceLM(CausalTransformer(TransformerConfig(**options)))   window required
      dense_conv, local_conv -> the same with conv=SHORT_CONV: a short causal conv before q/k/v (Zoology)

    count_model_parameters(kind, options, vocab_size, site)   counted on the meta device
    matched_options(kinds, sheaf_options, vocab_size, ...)   baselines' widths matched to the sheaf
                                                             model's parameter count (within 10%)
"""

from __future__ import annotations

import math
from dataclasses import asdict, fields, is_dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch_geometric.data import HeteroData

from sheafgnn.baselines import CausalTransformer, TransformerConfig, count_parameters, match_width
from sheafgnn.config import check_field_types
from sheafgnn.generation import TokenStream

MODEL_KINDS = ("sheaf", "dense", "local", "ssm", "dense_conv", "local_conv")
ATTENTION_KINDS = ("dense", "local", "dense_conv", "local_conv")
SHORT_CONV = 3  # the conv width of dense_conv and local_conv (Zoology's attention baselines use 3)


def attention_options(kind: str, options: dict) -> dict:
    """``options`` with what the attention ``kind`` implies: ``conv`` for the ``_conv`` kinds (their names
    say it, so ``options`` may not contradict them), and no ``window`` for dense ones."""
    conv = SHORT_CONV if kind.endswith("_conv") else 0
    if options.get("conv", conv) != conv:
        raise ValueError(f"build_model: model {kind!r} has conv={conv}; use "
                         f"{'dense_conv or local_conv' if options['conv'] else 'dense or local'} instead")
    dense = kind.startswith("dense")
    if dense and options.get("window") is not None:
        raise ValueError(f"build_model: model {kind!r} takes no window (got {options['window']}); "
                         f"use model {kind.replace('dense', 'local')!r}")
    if not dense and options.get("window") is None:
        raise ValueError(f"build_model: model {kind!r} needs model_config.window (tokens each position sees)")
    return {**options, "conv": conv}


class SequenceLM(nn.Module):
    r"""Runs a sequence model (token ids (B, T) -> logits (B, T, V)) on a batch of sites.

    All windows of a batch have the same length, and PyG concatenates them in
    order, so ``batch['token'].x`` reshapes to (B, T) without a copy.

    Args:
        net (nn.Module): e.g. a :class:`~sheafgnn.baselines.CausalTransformer`;
            it must have a ``config`` attribute.

    Shapes:
        - **input:** a ``Batch`` of B sites of T tokens each (or one site)
        - **output:** logits (B * T, V)
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.config = net.config

    def forward(self, batch: HeteroData) -> Tensor:
        x = batch["token"].x  # (B * T,)
        B = getattr(batch, "num_graphs", 1)
        if x.numel() % B != 0:
            raise ValueError(f"SequenceLM: {x.numel()} tokens do not split into {B} windows of equal length")
        return self.net(x.view(B, -1)).flatten(0, 1)  # (B * T, V)

    def stream(self, batch_size: int = 1) -> TokenStream:
        """The wrapped model's :class:`~sheafgnn.generation.TokenStream` for generation (a KV cache)."""
        return self.net.stream(batch_size)

    def loss(self, batch: HeteroData) -> Tensor:
        """Mean next-token cross-entropy over ``batch['token'].y`` (-100 ignored)."""
        logits = self(batch)  # (B * T, V)
        return F.cross_entropy(logits.float(), batch["token"].y, ignore_index=-100)


def config_dict(model: nn.Module) -> dict:
    """``model.config`` as a plain dict (``to_dict()`` if it has one)."""
    config = model.config
    if hasattr(config, "to_dict"):
        return config.to_dict()
    if is_dataclass(config):
        return asdict(config)
    raise TypeError(f"model.config must be a dataclass (got {type(config).__name__})")


def _check_fields(cls: type, options: dict, kind: str) -> None:
    unknown = sorted(set(options) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"model_config for model {kind!r} has unknown fields {unknown}; "
                         f"{cls.__name__} has {[f.name for f in fields(cls)]}")
    check_field_types(cls, options)


def build_model(kind: str, options: dict, vocab_size: int, site: dict | None = None) -> nn.Module:
    """Build a model of the given kind following the contract above.

    Args:
        kind (str): ``"sheaf"``, ``"ssm"`` (sheaf with gluing off), ``"dense"``,
            ``"local"``, ``"dense_conv"`` or ``"local_conv"``.
        options (dict): fields of the kind's config dataclass
            (:class:`~sheafgnn.model.SheafStateConfig` or
            :class:`~sheafgnn.baselines.TransformerConfig`).
        vocab_size (int): the tokenizer's vocabulary; ``options`` may repeat it
            but not contradict it.
        site (dict, optional): :class:`~sheafgnn.site.SiteConfig` fields, the
            rules the data was built with (sheaf and ssm read them).
    """
    if kind not in MODEL_KINDS:
        raise ValueError(f"build_model: model must be one of {MODEL_KINDS} (got {kind!r})")
    options = dict(options)
    if options.setdefault("vocab_size", vocab_size) != vocab_size:
        raise ValueError(f"build_model: model_config.vocab_size={options['vocab_size']} but the tokenizer has "
                         f"{vocab_size} ids; drop vocab_size from model_config")
    if kind in ATTENTION_KINDS:
        _check_fields(TransformerConfig, options, kind)
        return SequenceLM(CausalTransformer(TransformerConfig(**attention_options(kind, options))))
    from sheafgnn.flat_keys import nest_flat_keys
    from sheafgnn.model import SheafStateConfig, SheafStateLM

    if kind == "ssm" and (nest_flat_keys(options)[0].get("gluing") or {}).get("mode", "off") != "off":
        raise ValueError("build_model: model 'ssm' is the sheaf model with gluing off; drop model_config.gluing.mode")
    options = SheafStateConfig.nested(options)
    _check_fields(SheafStateConfig, options, kind)
    from sheafgnn.site import SiteConfig

    site = SiteConfig.from_dict(dict(site or {}))
    given = options.get("site", site)
    if (given if isinstance(given, SiteConfig) else SiteConfig.from_dict(given)) != site:
        raise ValueError("build_model: model_config.site differs from the data's site rules; set the site "
                         "options once, in the training config's top-level `site`")
    options["site"] = site
    if kind == "ssm":  # (an earlier version's flat config has gluing.mode outputs from FLAT_DEFAULTS: replaced)
        options["gluing"] = {**options.get("gluing", {}), "mode": "off"}
    return SheafStateLM(SheafStateConfig.from_dict(options))


def count_model_parameters(kind: str, options: dict, vocab_size: int, site: dict | None = None) -> int:
    """Parameters of ``build_model(kind, options, ...)``, counted on the meta device (no memory)."""
    import sheafgnn.model  # noqa: F401  first import outside the meta context: module-level tables stay on CPU

    with torch.device("meta"):
        return count_parameters(build_model(kind, options, vocab_size, site))


def _match_ssm_width(target: int, base: dict, vocab_size: int, tolerance: float) -> dict:
    """The ssm options (sheaf options, gluing off) whose d_model brings it closest to ``target`` parameters.

    Widths go in steps of ``stalk_dim``; at a width that the sheaf options' ``headdim`` does not divide (times
    ``expand``), the ssm takes the largest divisor of that headdim that does: steps of ``headdim`` (32 by default)
    are too coarse to match a small model within 10%."""
    from sheafgnn.model import SheafStateConfig

    defaults = SheafStateConfig()
    ssm, gluing = base.get("ssm") or {}, base.get("gluing") or {}
    base = {**base, "gluing": {**gluing, "mode": "off"}}
    step = gluing.get("stalk_dim", defaults.gluing.stalk_dim)
    headdim, expand = ssm.get("headdim", defaults.ssm.headdim), ssm.get("expand", defaults.ssm.expand)

    def options(k: int) -> dict:
        d = k * step
        return {**base, "d_model": d, "ssm": {**ssm, "headdim": math.gcd(headdim, d * expand)}}

    count = lambda k: count_model_parameters("ssm", options(k), vocab_size)
    lo, hi = 1, 1
    while count(hi) < target:
        lo, hi = hi, hi * 2
        if hi * step > 1 << 16:
            raise ValueError(f"matched_options: no ssm width up to {hi * step} reaches {target} parameters")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    best = min((lo, hi), key=lambda k: abs(count(k) - target))
    err = abs(count(best) - target) / target
    if err > tolerance:
        raise ValueError(f"matched_options: the closest ssm width d_model={best * step} is {err:.1%} from the sheaf "
                         f"model's {target} parameters (tolerance {tolerance:.0%}); change n_layers or expand")
    return options(best)


def matched_options(kinds: tuple[str, ...], sheaf_options: dict, vocab_size: int, *, n_heads: int, window: int,
                    site: dict | None = None, tolerance: float = 0.1) -> tuple[dict[str, dict], dict[str, int]]:
    """Model options with every baseline's width matched to the sheaf model's parameter count.

    Args:
        kinds (tuple[str, ...]): models wanted (the sheaf count is the target even if sheaf is absent).
        sheaf_options (dict): :class:`~sheafgnn.model.SheafStateConfig` fields, ``d_model`` and
            ``n_layers`` included; ssm uses them too, with gluing off and its own ``d_model``.
        vocab_size (int): the vocabulary.
        n_heads (int): attention heads of dense and local; their ``n_layers`` is the sheaf model's.
        window (int): the local model's attention window.
        site (dict, optional): the sheaf model's SiteConfig fields.
        tolerance (float, optional): the largest relative mismatch. (default: :obj:`0.1`)

    Returns:
        ``(options, counts)``: ``build_model`` options and parameter counts, per kind.
    """
    from sheafgnn.model import SheafStateConfig

    sheaf_options = SheafStateConfig.nested(sheaf_options)
    target = count_model_parameters("sheaf", sheaf_options, vocab_size, site)
    n_layers = sheaf_options.get("n_layers", 2)
    options, counts = {}, {}
    for kind in kinds:
        if kind == "sheaf":
            options[kind] = dict(sheaf_options)
        elif kind == "ssm":
            options[kind] = _match_ssm_width(target, dict(sheaf_options), vocab_size, tolerance)
        else:
            base = attention_options(kind, {"n_layers": n_layers, "n_heads": n_heads,
                                            "window": None if kind.startswith("dense") else window})
            cfg = match_width(target, lambda d, base=base: TransformerConfig(vocab_size=vocab_size, d_model=d, **base),
                              tolerance=tolerance)
            options[kind] = {"d_model": cfg.d_model, "n_layers": n_layers, "n_heads": n_heads}
            if kind.startswith("local"):
                options[kind]["window"] = window
        counts[kind] = count_model_parameters(kind, options[kind], vocab_size, site if kind == "sheaf" else None)
    counts["target"] = target
    return options, counts


def print_parameter_counts(options: dict[str, dict], counts: dict[str, int]) -> None:
    """A table of each model's width and parameter count vs the sheaf target."""
    print(f"{'model':<11}{'d_model':>9}{'params':>13}{'vs sheaf':>10}")
    for kind, opts in options.items():
        print(f"{kind:<11}{opts['d_model']:>9}{counts[kind]:>13,}{counts[kind] / counts['target'] - 1:>+10.1%}")
