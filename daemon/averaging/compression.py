"""Per-chunk codecs for the all-reduce, by name: "none", "fp16", "uint8", "quantile8" and "topk".

What a codec is and the checks every codec makes: codec.py. The codecs, each with its error
bound: "none" and "fp16" in float_codecs.py, "uint8" and "quantile8" in level_codecs.py, "topk"
and "sparse16" in sparse_codecs.py.

The average of several senders' top-k chunks is not top-k sparse: a reducer answers with
`reply_codec(topk)`, "sparse16" (every nonzero, fp16 values, or dense fp16 when that is smaller:
the "fp16" bound), and passes its own contribution through "topk" too, so that every contribution
is equally sparse (`sparsifies`).
"""

from __future__ import annotations

from .codec import Codec, CompressionError
from .float_codecs import Float16, NoCompression
from .level_codecs import Quantile8, Uniform8
from .sparse_codecs import SparseFloat16, TopK

CODECS: dict[str, Codec] = {codec.name: codec for codec in (NoCompression(), Float16(), Uniform8(),
                                                            Quantile8(), TopK())}
# the codecs reducers answer with where it is not the senders' own (not a choice of its own)
_REPLIES: dict[str, Codec] = {"topk": SparseFloat16()}


def reply_codec(codec: Codec) -> Codec:
    """The codec a reducer encodes its averages with for senders that use `codec`."""
    return _REPLIES.get(codec.name, codec)


def sparsifies(codec: Codec) -> bool:
    """Whether a reducer passes its own contribution through `codec` too: a sparsifying codec
    sends only part of each chunk, and one exact contribution would make the average (and the
    answer) dense and weigh that one member's small values above everyone else's."""
    return codec.name in _REPLIES


def get_codec(name: str) -> Codec:
    """The codec called `name`; CompressionError naming the known ones otherwise."""
    codec = CODECS.get(name)
    if codec is None:
        raise CompressionError(f"unknown compression {name!r} (known: {', '.join(CODECS)})")
    return codec
