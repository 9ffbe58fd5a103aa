"""sheafgnn: the Sheaf-State Language Model on PyTorch Geometric."""

__version__ = "0.1.0"
