"""sheafgnn: the Sheaf-State Language Model on PyTorch Geometric.

::

    from sheafgnn import SheafStateConfig, SheafStateLM, build_site
    data = build_site("The cat sat. It sat.\n")       # causal typed HeteroData
    logits = SheafStateLM(SheafStateConfig())(data)   # (num_tokens, 256)

On the CPU, call ``sheafgnn.tune_cpu()`` once before training (the ``sheafgnn`` command does): two
process-wide allocator settings that change no result (:func:`sheafgnn.memory.tune_cpu`).

Importing the package sets one more, unless the environment sets it: ``THP_MEM_ALLOC_ENABLE=1``, PyTorch's
huge pages for CPU tensors of 2 MiB and more (:func:`sheafgnn.memory.huge_pages_on`). PyTorch reads it at
its first CPU allocation, so it cannot wait for a call; ``THP_MEM_ALLOC_ENABLE=0`` keeps it off.
"""

import os

from sheafgnn.memory import HUGE_PAGES_VARIABLE, tune_cpu  # torch and the standard library only: no allocation

os.environ.setdefault(HUGE_PAGES_VARIABLE, "1")  # before torch_geometric, whose import allocates

from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.site import SiteBuilder, SiteConfig, build_site, validate_site

__version__ = "0.1.0"

__all__ = ["SheafStateConfig", "SheafStateLM", "SiteBuilder", "SiteConfig", "build_site", "tune_cpu", "validate_site"]
