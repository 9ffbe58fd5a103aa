"""Topic model for ``topic`` patches: scikit-learn hashing + mini-batch k-means.

Fitted once on the training corpus, then applied sentence by sentence, so a
sentence's topic depends on that sentence alone (never on the rest of the
text: that would leak the future into the graph). Saved as safetensors (the
centroids) with the vectoriser's settings in its metadata; loading unpickles
nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from sheafgnn.optional import missing

try:  # scikit-learn is in the experiments extra: without it TopicModel raises MissingExtra when used
    from sklearn.cluster import MiniBatchKMeans
    from sklearn.feature_extraction.text import HashingVectorizer
except ImportError:
    MiniBatchKMeans = HashingVectorizer = missing("sklearn", "TopicModel (topic patches)")


class TopicModel:
    """Nearest-centroid topics over hashed bag-of-words features.

    Args:
        centroids (Tensor): cluster centres, shape (num_topics, n_features).
        n_features (int): hashing dimension of the vectoriser.
    """

    def __init__(self, centroids: Tensor, n_features: int) -> None:
        if centroids.dim() != 2 or centroids.size(1) != n_features:
            raise ValueError(f"TopicModel: centroids must be (num_topics, {n_features}), got {tuple(centroids.shape)}")
        self.centroids = centroids.float()
        self.n_features = n_features
        self._vectorizer = HashingVectorizer(n_features=n_features, alternate_sign=False, norm="l2")
        self._half_sq_norm = 0.5 * (self.centroids**2).sum(1)  # (K,)

    @property
    def num_topics(self) -> int:
        return self.centroids.size(0)

    @classmethod
    def fit(cls, sentences: Sequence[str], num_topics: int = 16, n_features: int = 1 << 14,
            seed: int = 0) -> TopicModel:
        """Fit the centroids on ``sentences`` (the training corpus)."""
        if len(sentences) < num_topics:
            raise ValueError(f"TopicModel.fit: need at least num_topics={num_topics} sentences (got {len(sentences)})")
        features = HashingVectorizer(n_features=n_features, alternate_sign=False, norm="l2").transform(sentences)
        kmeans = MiniBatchKMeans(n_clusters=num_topics, random_state=seed, n_init=3, batch_size=1024)
        kmeans.fit(features)
        return cls(torch.from_numpy(np.asarray(kmeans.cluster_centers_, dtype=np.float32)), n_features)

    def predict(self, sentences: Sequence[str]) -> Tensor:
        """Topic id of each sentence, shape (len(sentences),)."""
        if len(sentences) == 0:
            return torch.zeros(0, dtype=torch.long)
        features = self._vectorizer.transform(sentences)  # sparse (S, n_features)
        scores = features @ self.centroids.numpy().T  # (S, K)
        return (torch.from_numpy(np.asarray(scores)) - self._half_sq_norm).argmax(1)

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        save_file({"centroids": self.centroids.contiguous()}, str(tmp),
                  metadata={"n_features": json.dumps(self.n_features)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TopicModel:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                n_features = int(json.loads(f.metadata()["n_features"]))
            return cls(load_file(str(path))["centroids"], n_features)
        except Exception as err:  # safetensors raises its own SafetensorError, not an OSError
            raise ValueError(f"could not load a TopicModel from {path}: {err}") from None
