"""The `albert` workload: ALBERT pre-training (masked language model + sentence order), as in DeDLOC.

The model is `transformers.AlbertForPreTraining` built from an `AlbertConfig` of a preset (no
weights are downloaded); the optimizer is LAMB with a linear warm-up and a linear decay to
`total_steps`; the data are WikiText-103, a folder of text files or the built-in corpus of the
standard library's docstrings (see corpus.py), tokenized by a Unigram tokenizer trained on it
(tokenizer.py), paired and masked as in ALBERT (pretraining.py).

Config keys whose default is 0 (-1 for `warmup_steps`) take the preset's value. Every peer of a
run must use the same config: it defines the task (the model, the corpus, the tokenizer); the
per-peer `seed` only picks the order in which a peer reads the documents and what it masks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..optim import Lamb, weight_decay_groups
from ..spec import ConfigField, Split, Workload
from .corpus import open_corpus
from .pretraining import IGNORE_INDEX, Prefetched, batches
from .tokenizer import load_vocabulary

PRESETS: dict[str, dict[str, Any]] = {
    # The DeDLOC paper's model: ~18M parameters (one layer shared by all 24).
    "albert-large": {
        "model": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                  "intermediate_size": 4096, "embedding_size": 128},
        "vocab_size": 30000, "max_seq_length": 512, "batch_size": 8,
        "lr": 0.00176, "warmup_steps": 5000, "total_steps": 125000,
    },
    # ~12M parameters.
    "albert-base": {
        "model": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "intermediate_size": 3072, "embedding_size": 128},
        "vocab_size": 30000, "max_seq_length": 512, "batch_size": 16,
        "lr": 0.00176, "warmup_steps": 5000, "total_steps": 125000,
    },
    # For tests and demos: a step takes milliseconds on a CPU.
    "albert-tiny": {
        "model": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                  "intermediate_size": 256, "embedding_size": 32},
        "vocab_size": 4000, "max_seq_length": 64, "batch_size": 16,
        "lr": 0.03, "warmup_steps": 10, "total_steps": 5000,
    },
}

MIN_SEQ_LENGTH = 8
MAX_POSITIONS = 512
"""Position embeddings: 512 as in ALBERT, or max_seq_length when it is longer."""

CONFIG = {
    "preset": ConfigField(str, "albert-large", "Model size and default hyper-parameters: albert-large "
                          "(DeDLOC's, ~18M parameters), albert-base (~12M) or albert-tiny (tests, demos).",
                          choices=tuple(PRESETS)),
    "max_seq_length": ConfigField(int, 0, "Tokens per example ([CLS] A [SEP] B [SEP], padded); 0: the "
                                  "preset's (512; tiny: 64).", minimum=0, maximum=8192),
    "vocab_size": ConfigField(int, 0, "Tokenizer and embedding vocabulary size; 0: the preset's (30000; "
                              "tiny: 4000).", minimum=0, maximum=1 << 20),
    "batch_size": ConfigField(int, 0, "Examples per forward pass; 0: the preset's (large: 8, base: 16, "
                              "tiny: 16).", minimum=0, maximum=1 << 16),
    "lr": ConfigField(float, 0.0, "LAMB's peak learning rate; 0: the preset's (0.00176; tiny: 0.03).",
                      minimum=0.0, maximum=10.0),
    "warmup_steps": ConfigField(int, -1, "Linear warm-up steps; -1: the preset's (5000; tiny: 10).",
                                minimum=-1, maximum=1 << 30),
    "total_steps": ConfigField(int, 0, "Step at which the linear decay reaches 0; 0: the preset's "
                               "(125000; tiny: 5000).", minimum=0, maximum=1 << 30),
    "weight_decay": ConfigField(float, 0.01, "Weight decay, in LAMB's update (not on biases and "
                                "normalisation weights).", minimum=0.0, maximum=1.0),
    "max_grad_norm": ConfigField(float, 1.0, "Clip the averaged gradient to this global L2 norm before "
                                 "each step; 0: no clipping.", minimum=0.0, maximum=1e6),
    "mlm_probability": ConfigField(float, 0.15, "Share of tokens chosen for masked-language modelling.",
                                   minimum=0.01, maximum=0.9),
    "data_dir": ConfigField(str, "", "Folder with WikiText-103 raw files (wiki.train.raw, wiki.valid.raw) "
                            "or *.txt files; empty: the built-in corpus (the standard library's "
                            "docstrings)."),
    "tokenizer_path": ConfigField(str, "", "A tokenizer.json (the `tokenizers` library) to use; empty: "
                                  "train a Unigram tokenizer on the corpus (cached)."),
    "cache_dir": ConfigField(str, "", "Where the built-in corpus and trained tokenizers are cached; "
                             "empty: $XDG_CACHE_HOME/dedloc/albert (~/.cache/dedloc/albert)."),
    "data_prefetch": ConfigField(int, 4, "Train batches a background thread prepares ahead, so that "
                                 "tokenizing and masking overlap the step; 0: none.",
                                 minimum=0, maximum=1024),
    "mixed_precision": ConfigField(str, "auto", "Autocast on a GPU: auto (bf16 where supported, else "
                                   "off), bf16, fp16 (no loss scaling) or off. Always off on a CPU.",
                                   choices=("auto", "bf16", "fp16", "off")),
}


@dataclass(frozen=True)
class Settings:
    """A resolved config with the preset's values filled in."""

    preset: str
    model: dict[str, int]
    vocab_size: int
    max_seq_length: int
    batch_size: int
    lr: float
    warmup_steps: int
    total_steps: int
    weight_decay: float
    max_grad_norm: float
    mlm_probability: float
    data_dir: str
    tokenizer_path: str
    cache_dir: Path
    mixed_precision: str


def settings(config: dict[str, Any]) -> Settings:
    """`config` (as the worker resolved it) with the preset's values where it says 0 (or -1)."""
    preset = PRESETS[config["preset"]]

    def pick(key: str, unset: Any = 0) -> Any:
        return preset[key] if config[key] == unset else config[key]

    max_seq_length = pick("max_seq_length")
    if max_seq_length < MIN_SEQ_LENGTH:
        raise ValueError(f"max_seq_length must be at least {MIN_SEQ_LENGTH}, not {max_seq_length}")
    return Settings(
        preset=config["preset"], model=dict(preset["model"]), vocab_size=pick("vocab_size"),
        max_seq_length=max_seq_length, batch_size=pick("batch_size"), lr=pick("lr"),
        warmup_steps=pick("warmup_steps", -1), total_steps=pick("total_steps"),
        weight_decay=config["weight_decay"], max_grad_norm=config["max_grad_norm"],
        mlm_probability=config["mlm_probability"], data_dir=config["data_dir"],
        tokenizer_path=config["tokenizer_path"], cache_dir=cache_dir(config["cache_dir"]),
        mixed_precision=config["mixed_precision"])


def cache_dir(configured: str) -> Path:
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "dedloc" / "albert"


def albert_config(config: dict[str, Any]) -> Any:
    """The `transformers.AlbertConfig` of a resolved config (ALBERT v2: no dropout in the encoder)."""
    from transformers import AlbertConfig

    resolved = settings(config)
    return AlbertConfig(vocab_size=resolved.vocab_size,
                        max_position_embeddings=max(MAX_POSITIONS, resolved.max_seq_length),
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        pad_token_id=0, **resolved.model)


def autocast_dtype(mode: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `mode` on `device` (None: full precision)."""
    if device.type != "cuda" or mode == "off":
        return None
    if mode == "fp16":
        return torch.float16
    if mode == "bf16" or torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return None


def build_model(config: dict[str, Any], device: torch.device) -> nn.Module:
    from transformers import AlbertForPreTraining

    model = AlbertForPreTraining(albert_config(config)).to(device)
    model.autocast_dtype = autocast_dtype(config["mixed_precision"], device)
    return model


def linear_schedule(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The learning-rate factor at a step: linear warm-up to 1, then linear decay to 0 at total_steps."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if total_steps <= warmup_steps:
            return 1.0
        return max(0.0, (total_steps - step) / (total_steps - warmup_steps))

    return factor


def build_optimizer(model: nn.Module, config: dict[str, Any]
                    ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    resolved = settings(config)
    optimizer = Lamb(weight_decay_groups(model, resolved.weight_decay), lr=resolved.lr,
                     betas=(0.9, 0.999), eps=1e-6, max_grad_norm=resolved.max_grad_norm or None)
    schedule = linear_schedule(resolved.warmup_steps, resolved.total_steps)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def build_data(config: dict[str, Any], seed: int, split: Split) -> Iterator[dict[str, torch.Tensor]]:
    resolved = settings(config)
    corpus = open_corpus(resolved.data_dir, resolved.cache_dir)
    vocab = load_vocabulary(corpus, resolved.vocab_size, resolved.tokenizer_path, resolved.cache_dir)
    stream = batches(corpus.split(split), vocab, resolved.max_seq_length, resolved.batch_size, seed,
                     split, resolved.mlm_probability)
    # Eval iterators are made for each evaluation and dropped after a few batches: no thread.
    if split == "train" and config["data_prefetch"] > 0:
        return Prefetched(stream, config["data_prefetch"])
    return stream


def task_fingerprint(config: dict[str, Any]) -> str:
    """The vocabulary's identity: peers whose tokenizers differ must not train one model.

    A tokenizer trained on the built-in corpus depends on the Python version (the docstrings), one
    trained on `data_dir` on that folder's text: both can differ between peers with the same config.
    """
    resolved = settings(config)
    corpus = open_corpus(resolved.data_dir, resolved.cache_dir)
    vocab = load_vocabulary(corpus, resolved.vocab_size, resolved.tokenizer_path, resolved.cache_dir)
    return "vocab-" + hashlib.sha256(vocab.tokenizer.to_str().encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Outputs:
    """One forward pass: the two losses, the logits of the masked tokens and of sentence order."""

    mlm_loss: torch.Tensor
    sop_loss: torch.Tensor
    mlm_logits: torch.Tensor
    mlm_labels: torch.Tensor
    sop_logits: torch.Tensor
    sop_labels: torch.Tensor


def forward(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> Outputs:
    """AlbertForPreTraining's two losses, with the MLM head applied to the masked positions only.

    The same numbers as `model(**batch).loss` (mean cross-entropy over the masked tokens plus the
    mean over the batch of the sentence-order cross-entropy), without the vocabulary-sized logits
    of every unmasked position.
    """
    inputs = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
    dtype = getattr(model, "autocast_dtype", None)
    context = (torch.autocast(device.type, dtype=dtype) if dtype is not None
               else contextlib.nullcontext())
    labels = inputs["labels"]
    chosen = labels != IGNORE_INDEX
    with context:
        hidden = model.albert(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                              token_type_ids=inputs["token_type_ids"])
        mlm_logits = model.predictions(hidden.last_hidden_state[chosen]).float()
        sop_logits = model.sop_classifier(hidden.pooler_output).float()
    mlm_labels = labels[chosen]
    # A batch where no token was masked has no MLM term (cross-entropy of nothing is NaN).
    mlm_loss = (F.cross_entropy(mlm_logits, mlm_labels) if mlm_labels.numel()
                else mlm_logits.sum() * 0.0)
    sop_labels = inputs["sentence_order_label"]
    return Outputs(mlm_loss, F.cross_entropy(sop_logits, sop_labels), mlm_logits, mlm_labels,
                   sop_logits, sop_labels)


def loss(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
         ) -> tuple[torch.Tensor, int]:
    outputs = forward(model, batch, device)
    return outputs.mlm_loss + outputs.sop_loss, int(batch["input_ids"].shape[0])


def metrics(model: nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    outputs = forward(model, batch, device)
    mlm_correct = (outputs.mlm_logits.argmax(dim=-1) == outputs.mlm_labels).float()
    sop_correct = (outputs.sop_logits.argmax(dim=-1) == outputs.sop_labels).float()
    return {
        "mlm_accuracy": float(mlm_correct.mean()) if mlm_correct.numel() else 0.0,
        "sop_accuracy": float(sop_correct.mean()),
        "mlm_loss": float(outputs.mlm_loss),
        "sop_loss": float(outputs.sop_loss),
    }


ALBERT = Workload(
    name="albert",
    description="ALBERT pre-training (masked language model + sentence order prediction) with LAMB, "
                "as in the DeDLOC paper: WikiText-103, a folder of text files, or the built-in corpus "
                "of the standard library's docstrings.",
    version="1",
    config=CONFIG,
    build_model=build_model,
    build_optimizer=build_optimizer,
    build_data=build_data,
    loss=loss,
    metrics=metrics,
    task_fingerprint=task_fingerprint,
)
