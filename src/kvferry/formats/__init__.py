"""Engine KV layouts as data: the declarations and what is derived from them."""

from kvferry.formats.codec import CODECS, Codec, with_codec
from kvferry.formats.geometry import KVGeometry, Stripe, describe, flatten_paged, object_dtype, object_shape
from kvferry.formats.kinds import EngineKVFormat
from kvferry.formats.layer_split import LayerPart, LayerSplit, layer_split, select_layers
from kvferry.formats.layouts import LAYOUTS, Layout, layout_of

__all__ = [
    "CODECS",
    "LAYOUTS",
    "Codec",
    "EngineKVFormat",
    "KVGeometry",
    "LayerPart",
    "LayerSplit",
    "Layout",
    "Stripe",
    "describe",
    "flatten_paged",
    "layer_split",
    "layout_of",
    "object_dtype",
    "object_shape",
    "select_layers",
    "with_codec",
]
