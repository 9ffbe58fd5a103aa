"""sheafgnn: the Sheaf-State Language Model on PyTorch Geometric.

::

    from sheafgnn import SheafStateConfig, SheafStateLM, build_site
    data = build_site("The cat sat. It sat.\n")       # causal typed HeteroData
    logits = SheafStateLM(SheafStateConfig())(data)   # (num_tokens, 256)

On the CPU, call ``sheafgnn.tune_cpu()`` once before training (the ``sheafgnn`` command does): two
process-wide allocator settings that change no result (:func:`sheafgnn.memory.tune_cpu`).
"""

from sheafgnn.memory import tune_cpu
from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.site import SiteBuilder, SiteConfig, build_site, validate_site

__version__ = "0.1.0"

__all__ = ["SheafStateConfig", "SheafStateLM", "SiteBuilder", "SiteConfig", "build_site", "tune_cpu", "validate_site"]
