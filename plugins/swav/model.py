"""The SwAV model (Caron et al., 2020): a ResNet trunk, a projection head, prototypes, and the
swapped-prediction loss with codes from Sinkhorn-Knopp.

Per training call of `SwAV.swav_loss(crops)` (crops: a list of `[B, 3, H, W]` tensors, the large
assignment crops first):

1. the prototypes are L2-normalised in place (so that scores are cosine similarities);
2. every crop is embedded (crops of one resolution in one trunk pass; the head sees all of them,
   as one batch for its BatchNorm) and the embeddings `z` are L2-normalised;
3. scores = z @ prototypes.T (in float32, outside autocast); during the first
   `freeze_prototypes_steps` steps the prototypes enter detached, so they get no gradient;
4. for each assignment crop i, codes q_i = Sinkhorn-Knopp(scores_i) without gradient, computed
   together with the queued embeddings of earlier batches when the queue is on (step >=
   `queue_start_step`), keeping only the rows of this batch;
5. loss = mean over i of [ mean over crops v != i of CE(q_i, softmax(scores_v / temperature)) ];
6. the embeddings of the assignment crops are pushed into the queue (newest first).

The step comes from `step_source` (the workload points it at the LR scheduler, which the worker
positions at the run's global step). The queue is a plain tensor, not a buffer: it is per-peer
scratch, never averaged, exported or saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Trunk constructors of torchvision by preset, and the width of their pooled features.
PRESETS: dict[str, int] = {"resnet18": 512, "resnet50": 2048}


@torch.no_grad()
def sinkhorn_knopp(scores: torch.Tensor, epsilon: float, iterations: int) -> torch.Tensor:
    """Codes for `scores` ([N, K]: N samples, K prototypes): an [N, K] float32 tensor, no gradient.

    The transport plan Q ([K, N]) starts as exp(scores / epsilon), transposed, divided by its
    total (computed in float64, after subtracting the largest score, which the normalisation
    cancels). Each of the `iterations` then does, in this order:

    - row step: every prototype's row is divided by its sum and by K (each prototype's total
      mass is then exactly 1/K);
    - column step: every sample's column is divided by its sum and by N (each sample's total
      mass is then exactly 1/N).

    The result is Q * N, transposed: each sample's codes sum to 1 (exactly, as the last step was
    a column step), and each prototype's codes sum to N/K up to the drift of that last column
    step, which vanishes as the iterations converge.
    """
    if iterations < 1:
        raise ValueError(f"sinkhorn_knopp needs at least 1 iteration, got {iterations}")
    logits = scores.detach().double()
    plan = torch.exp((logits - logits.max()) / epsilon).t()
    plan /= plan.sum()
    prototypes, samples = plan.shape
    for _ in range(iterations):
        plan /= plan.sum(dim=1, keepdim=True)
        plan /= prototypes
        plan /= plan.sum(dim=0, keepdim=True)
        plan /= samples
    return (plan * samples).t().float()


def swapped_prediction_loss(scores: torch.Tensor, codes: Sequence[torch.Tensor], crops: int,
                            temperature: float) -> torch.Tensor:
    """Mean over assignment crops i of the mean over other crops v of CE(q_i, softmax(s_v / T)).

    `scores` is [crops * B, K] (crop-major); `codes[i]` is the [B, K] codes of crop i (the first
    len(codes) crops are the assignment crops).
    """
    batch = scores.shape[0] // crops
    log_probs = F.log_softmax(scores / temperature, dim=1).split(batch)
    total = scores.new_zeros(())
    for i, q in enumerate(codes):
        swapped = [-(q * log_probs[v]).sum(dim=1).mean() for v in range(crops) if v != i]
        total = total + torch.stack(swapped).mean()
    return total / len(codes)


class SwAV(nn.Module):
    """ResNet trunk, projection head, L2-normalised embeddings and prototypes, with SwAV's loss."""

    def __init__(self, preset: str = "resnet50", *, hidden_dim: int = 0, feature_dim: int = 128,
                 prototypes: int = 3000, temperature: float = 0.1, epsilon: float = 0.05,
                 sinkhorn_iterations: int = 3, assign_crops: int = 2, queue_length: int = 0,
                 queue_start_step: int = 0, freeze_prototypes_steps: int = 0,
                 mixed_precision: bool = True) -> None:
        super().__init__()
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r} (known: {', '.join(PRESETS)})")
        import torchvision  # heavy: imported here so that listing the plugin stays cheap

        self.preset = preset
        self.trunk = getattr(torchvision.models, preset)(weights=None)
        self.trunk.fc = nn.Identity()
        width = PRESETS[preset]
        hidden = hidden_dim or width
        self.head = nn.Sequential(nn.Linear(width, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                                  nn.Linear(hidden, feature_dim))
        self.prototypes = nn.Linear(feature_dim, prototypes, bias=False)
        self.temperature = temperature
        self.epsilon = epsilon
        self.sinkhorn_iterations = sinkhorn_iterations
        self.assign_crops = assign_crops
        self.queue_length = queue_length
        self.queue_start_step = queue_start_step
        self.freeze_prototypes_steps = freeze_prototypes_steps
        self.mixed_precision = mixed_precision
        self.step_source: Callable[[], int] = lambda: 0
        self.queue: torch.Tensor | None = None  # [assign_crops, queue_length, feature_dim]
        self.queue_filled = 0
        self.last: dict[str, Any] = {}  # what the last swav_loss call did (for tests and metrics)
        self.normalize_prototypes()

    # --- pieces ---------------------------------------------------------------------------------

    def global_step(self) -> int:
        return int(self.step_source())

    @torch.no_grad()
    def normalize_prototypes(self) -> None:
        weight = self.prototypes.weight
        weight.copy_(F.normalize(weight, dim=1))

    def _autocast(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.mixed_precision and device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def embed(self, crops: Sequence[torch.Tensor]) -> torch.Tensor:
        """The L2-normalised float32 embeddings of all crops, crop-major: [len(crops) * B, D]."""
        with self._autocast(crops[0].device):
            features = [self.trunk(torch.cat(group)) for group in _same_size_runs(crops)]
            projected = self.head(torch.cat(features))
        return F.normalize(projected.float(), dim=1)

    def forward(self, crops: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings, prototype scores) of all crops, crop-major."""
        embeddings = self.embed(crops)
        return embeddings, embeddings @ self.prototypes.weight.float().t()

    # --- loss -----------------------------------------------------------------------------------

    def codes(self, scores: torch.Tensor, batch: int, use_queue: bool) -> list[torch.Tensor]:
        """Sinkhorn codes of each assignment crop (with the queue's rows in front when in use)."""
        weight = self.prototypes.weight.detach().float()
        found = []
        for i in range(self.assign_crops):
            crop_scores = scores[i * batch:(i + 1) * batch].detach()
            if use_queue and self.queue is not None and self.queue_filled:
                queued = self.queue[i, :self.queue_filled] @ weight.t()
                crop_scores = torch.cat([queued, crop_scores])
            found.append(sinkhorn_knopp(crop_scores, self.epsilon, self.sinkhorn_iterations)[-batch:])
        return found

    def swav_loss(self, crops: Sequence[torch.Tensor]) -> torch.Tensor:
        """The swapped-prediction loss of one multi-crop batch (see the module doc)."""
        if len(crops) < max(2, self.assign_crops):
            raise ValueError(f"SwAV needs at least 2 crops and {self.assign_crops} assignment crops, "
                             f"got {len(crops)} crops")
        batch = crops[0].shape[0]
        step = self.global_step()
        self.normalize_prototypes()
        frozen = self.training and step < self.freeze_prototypes_steps
        embeddings = self.embed(crops)
        weight = self.prototypes.weight.float()
        scores = embeddings @ (weight.detach() if frozen else weight).t()
        queue_on = self.training and self.queue_length > 0 and step >= self.queue_start_step
        queued = self.queue_filled if queue_on and self.queue is not None else 0
        codes = self.codes(scores, batch, queue_on)
        loss = swapped_prediction_loss(scores, codes, len(crops), self.temperature)
        if queue_on:
            self._push(embeddings[:self.assign_crops * batch].detach(), batch)
        self.last = {"step": step, "frozen": frozen, "queue_used": queued, "codes": codes,
                     "scores": scores.detach(), "batch": batch, "crops": len(crops)}
        return loss

    @torch.no_grad()
    def _push(self, embeddings: torch.Tensor, batch: int) -> None:
        new = embeddings.float().reshape(self.assign_crops, batch, -1)
        if self.queue is None or self.queue.device != new.device:
            self.queue = new.new_zeros(self.assign_crops, self.queue_length, new.shape[-1])
            self.queue_filled = 0
        self.queue = torch.cat([new, self.queue], dim=1)[:, :self.queue_length].contiguous()
        self.queue_filled = min(self.queue_length, self.queue_filled + batch)

    def reset_queue(self) -> None:
        self.queue = None
        self.queue_filled = 0


def _same_size_runs(crops: Sequence[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """The crops in runs of consecutive tensors of one spatial size (one trunk pass each)."""
    run: list[torch.Tensor] = []
    for crop in crops:
        if run and crop.shape[-2:] != run[0].shape[-2:]:
            yield run
            run = []
        run.append(crop)
    if run:
        yield run


@torch.no_grad()
def assignment_stats(model: SwAV) -> dict[str, float]:
    """Numbers about the last `swav_loss` call: code entropy, prototype usage, swap agreement.

    - code_entropy: mean entropy (nats) of a sample's codes (low: confident assignments);
    - prototype_usage: distinct prototypes that are some sample's top code, over min(samples, K)
      (1: every sample of the batch on its own prototype; 1/samples: collapse onto one);
    - prediction_entropy: mean entropy of softmax(scores / temperature) of all crops;
    - swap_agreement: how often the top prototype predicted from crop v is crop i's top code.
    """
    last = model.last
    codes = torch.cat(last["codes"])
    scores, batch, crops = last["scores"], last["batch"], last["crops"]
    entropy = -(codes * codes.clamp_min(1e-12).log()).sum(dim=1).mean()
    top = torch.cat([q.argmax(dim=1) for q in last["codes"]])
    usage = top.unique().numel() / min(top.numel(), codes.shape[1])
    probs = F.softmax(scores / model.temperature, dim=1)
    prediction_entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=1).mean()
    predicted = scores.argmax(dim=1).split(batch)
    agree = [(predicted[v] == q.argmax(dim=1)).float().mean()
             for i, q in enumerate(last["codes"]) for v in range(crops) if v != i]
    return {"code_entropy": float(entropy), "prototype_usage": usage,
            "prediction_entropy": float(prediction_entropy),
            "swap_agreement": float(torch.stack(agree).mean())}
