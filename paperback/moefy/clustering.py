"""Balanced k-means: split n points into k clusters of exactly n / k points each.

MoEfication groups an MLP's neurons into experts of equal size (a standard MoE checkpoint stores one
intermediate size for every expert), so plain k-means, whose clusters come out of any size, does not do.
Each assignment step gives points to centroids greedily, most similar pair first, until every centroid
holds its quota; the centroids are then the means of their points, as in k-means.
"""

from __future__ import annotations

import torch


def balanced_assign(similarity: torch.Tensor, quota: int) -> torch.Tensor:
    """similarity (n, k) -> labels (n,): each point to one cluster, every cluster exactly `quota` points
    (n == k * quota), pairs taken in order of decreasing similarity."""
    n, k = similarity.shape
    if n != k * quota:
        raise ValueError(f"{n} points do not split into {k} clusters of {quota}")
    order = torch.argsort(similarity.flatten(), descending=True).tolist()
    labels = [-1] * n
    room = [quota] * k
    left = n
    for flat in order:
        point, cluster = divmod(flat, k)
        if labels[point] < 0 and room[cluster]:
            labels[point], room[cluster] = cluster, room[cluster] - 1
            left -= 1
            if not left:
                break
    return torch.tensor(labels)


def balanced_kmeans(points: torch.Tensor, k: int, iterations: int = 25, seed: int = 0) -> torch.Tensor:
    """points (n, d), compared by cosine similarity -> labels (n,) in [0, k), n / k points per label."""
    n = points.shape[0]
    if n % k:
        raise ValueError(f"{n} points do not split into {k} equal clusters")
    unit = torch.nn.functional.normalize(points.float(), dim=1)
    generator = torch.Generator().manual_seed(seed)
    centroids = unit[torch.randperm(n, generator=generator)[:k]]
    labels = None
    for _ in range(iterations):
        new = balanced_assign(unit @ centroids.T, n // k)
        if labels is not None and torch.equal(new, labels):
            break
        labels = new
        centroids = torch.nn.functional.normalize(
            torch.zeros(k, unit.shape[1]).index_add_(0, labels, unit), dim=1)
    return labels
