"""Engine KV layouts as data: the declarations and what is derived from them."""

from kvferry.formats.codec import CODECS, Codec, with_codec
from kvferry.formats.geometry import KVGeometry, Stripe, describe, flatten_paged, object_dtype, object_shape
from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layouts import LAYOUTS, Layout, layout_of

__all__ = [
    "CODECS",
    "LAYOUTS",
    "Codec",
    "EngineKVFormat",
    "KVGeometry",
    "Layout",
    "Stripe",
    "describe",
    "flatten_paged",
    "layout_of",
    "object_dtype",
    "object_shape",
    "with_codec",
]
