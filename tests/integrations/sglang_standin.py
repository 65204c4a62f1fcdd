"""A stand-in for torchvision, for importing SGLang's host KV pool on a machine without torchvision.

SGLang's memory pools import its model configs (`sglang.srt.configs`), two of which import torchvision at module
level for image preprocessing (`InterpolationMode`, `transforms.functional`); nothing of the KV cache uses it. The
stand-in gives those names only, and transformers is asked first, so that it keeps seeing no torchvision. Imported
by the SGLang checks in their own child process (`test_sglang_release`), never in a shared pytest process.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"


def install() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return  # the real one
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()  # answered (and cached) before the stand-in exists: False
    modules = {}
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        modules[name] = module
    modules["torchvision.transforms"].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    modules["torchvision.transforms.functional"].InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    modules["torchvision.transforms"].functional = modules["torchvision.transforms.functional"]  # type: ignore[attr-defined]
    modules["torchvision"].transforms = modules["torchvision.transforms"]  # type: ignore[attr-defined]
    sys.modules.update(modules)
