"""Parameter shapes of well-known models, for optimizer benchmarks (no model code needed)."""

from __future__ import annotations


def resnet50_shapes() -> list[tuple]:
    """ResNet-50's 161 parameter tensors (25.6M parameters), in torchvision's order."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out_ch = width * 4
        for b in range(blocks):
            shapes += [(width, in_ch, 1, 1), (width,), (width,),
                       (width, width, 3, 3), (width,), (width,),
                       (out_ch, width, 1, 1), (out_ch,), (out_ch,)]
            if b == 0:
                shapes += [(out_ch, in_ch, 1, 1), (out_ch,), (out_ch,)]
            in_ch = out_ch
    return shapes + [(1000, 2048), (1000,)]


def bert_base_shapes() -> list[tuple]:
    """BERT-base's 197 encoder parameter tensors (109M parameters; no pooler)."""
    h, ff = 768, 3072
    shapes = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        shapes += [(h, h), (h,)] * 4 + [(h,), (h,), (ff, h), (ff,), (h, ff), (h,), (h,), (h,)]
    return shapes


def linear_stack_shapes(count: int = 100, width: int = 128) -> list[tuple]:
    """``count`` x Linear(width, width): weight and bias each."""
    return [(width, width), (width,)] * count


def many_small_shapes(count: int = 2000, size: int = 4096) -> list[tuple]:
    return [(size,)] * count
