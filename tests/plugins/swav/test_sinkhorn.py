"""Sinkhorn-Knopp codes: what each step normalises, and the marginals of the result.

`sinkhorn_knopp(scores [N, K], epsilon, iterations)` builds the plan Q = exp(scores / epsilon)^T
([K, N]) divided by its total, then alternates per iteration: a row step (each prototype's row
divided by its sum and by K: prototype masses exactly 1/K) and a column step (each sample's
column divided by its sum and by N: sample masses exactly 1/N). It returns (Q * N)^T, so each
sample's codes sum to exactly 1; each prototype's codes sum to N/K up to the last column step's
drift, which vanishes as the iterations converge.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dedloc.plugins.swav.model import sinkhorn_knopp


def cosine_scores(samples: int, prototypes: int, dim: int = 16) -> torch.Tensor:
    """Scores as SwAV computes them: normalised embeddings times normalised prototypes."""
    embeddings = F.normalize(torch.randn(samples, dim), dim=1)
    centres = F.normalize(torch.randn(prototypes, dim), dim=1)
    return embeddings @ centres.t()


def reference(scores: torch.Tensor, epsilon: float, iterations: int) -> torch.Tensor:
    """The algorithm written out in float64, checking each step's marginal as it goes."""
    plan = torch.exp(scores.double() / epsilon).t()
    plan = plan / plan.sum()
    k, n = plan.shape
    for _ in range(iterations):
        plan = plan / plan.sum(dim=1, keepdim=True) / k
        torch.testing.assert_close(plan.sum(dim=1), torch.full((k,), 1 / k, dtype=torch.float64))
        plan = plan / plan.sum(dim=0, keepdim=True) / n
        torch.testing.assert_close(plan.sum(dim=0), torch.full((n,), 1 / n, dtype=torch.float64))
    return (plan * n).t()


@pytest.mark.parametrize(("samples", "prototypes"), [(32, 10), (8, 64), (40, 40)])
def test_three_iterations_match_the_written_out_algorithm(samples: int, prototypes: int) -> None:
    scores = cosine_scores(samples, prototypes)
    codes = sinkhorn_knopp(scores, 0.05, 3)
    assert codes.shape == (samples, prototypes) and codes.dtype == torch.float32
    assert not codes.requires_grad
    torch.testing.assert_close(codes.double(), reference(scores, 0.05, 3), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(("samples", "prototypes"), [(32, 10), (8, 64)])
def test_each_samples_codes_sum_to_one(samples: int, prototypes: int) -> None:
    codes = sinkhorn_knopp(cosine_scores(samples, prototypes), 0.05, 3)
    assert bool((codes >= 0).all())
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(samples), rtol=0, atol=1e-4)


def test_prototypes_get_equal_mass_once_converged() -> None:
    samples, prototypes = 48, 12
    scores = cosine_scores(samples, prototypes)
    codes = sinkhorn_knopp(scores, 0.05, 300)
    # Each prototype's share of the total mass (N): 1/K.
    torch.testing.assert_close(codes.sum(dim=0) / samples, torch.full((prototypes,), 1 / prototypes),
                               rtol=0, atol=1e-4)
    torch.testing.assert_close(codes.sum(dim=1), torch.ones(samples), rtol=0, atol=1e-4)


def test_three_iterations_already_spread_a_crowd_over_the_prototypes() -> None:
    # Every sample prefers prototype 0: a softmax would put (almost) all of them there.
    samples, prototypes = 32, 8
    scores = 0.2 * torch.rand(samples, prototypes)
    scores[:, 0] += 0.5
    assert float(F.softmax(scores / 0.05, dim=1)[:, 0].mean()) > 0.99
    masses = sinkhorn_knopp(scores, 0.05, 3).sum(dim=0) / samples
    torch.testing.assert_close(masses, torch.full((prototypes,), 1 / prototypes), rtol=0.05, atol=0)


def test_a_shift_of_all_scores_changes_nothing() -> None:
    scores = cosine_scores(16, 20)
    torch.testing.assert_close(sinkhorn_knopp(scores + 50.0, 0.05, 3), sinkhorn_knopp(scores, 0.05, 3))


def test_needs_an_iteration() -> None:
    with pytest.raises(ValueError, match="at least 1 iteration"):
        sinkhorn_knopp(cosine_scores(4, 4), 0.05, 0)
