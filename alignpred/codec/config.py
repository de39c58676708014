"""Codec configuration: every switch that changes the bitstream, written into the file header.

>>> c = CodecConfig()
>>> CodecConfig.from_json(c.to_json()) == c
True
>>> CodecConfig.from_json({"object_size": 256}).sink_origin    # a 1.0 header: file-relative sink
'file'
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from alignpred.errors import KvzError

ARITHS = ("float", "exact")
SINK_ORIGINS = ("file", "absolute")


@dataclass(frozen=True)
class CodecConfig:
    """Every switch that changes the bitstream; written into the file header.

    ``align``: code blocks in their GPA-aligned frame. ``inter_map``: allow the linear-map
    predictor. ``blend``: allow the paper's lambda-blended aligned predictor. ``intra``: allow
    token interpolation. ``channel_choice``: choose the mode per channel (else one per block).
    ``rope_undo``: code keys with RoPE undone. ``sink_tokens``/``sink_scale``: positions of the
    sequence below ``sink_tokens`` (the attention sink, where errors in the keys cost the most
    downstream) are quantised with the step times ``sink_scale``; ``sink_origin`` says where
    positions count from: ``absolute`` (the sequence's first token, using the layout's
    ``position_offset``: a chunk from the middle of a prompt pays nothing) or ``file`` (the
    file's first position: kvz 0.1). ``arith``: the decoder's arithmetic — ``exact`` (format
    1.1: integer map products and platform-independent RoPE tables; the decoded bits are the
    same on every machine and thread count; the default) or ``float`` (format 1.0: BLAS
    products; the default with ``align``, whose rotations are float products).
    ``channel_steps`` (format 1.3): every tensor carries a step multiplier per channel
    (``tensors[].step_codes``, ``code / 32``), so the error goes where the model reads it (the
    ``attention`` scope sets it; exact arithmetic only). ``stale_window`` / ``stale_scale``
    (format 1.3): in sliding-window layers (``layout.layer_types`` naming ``sliding``), positions
    that no later query attends — older than the last ``stale_window - 1`` positions of the file
    — are quantised with the step times ``stale_scale`` (``stale_window = 0``: off).
    ``row_steps`` (format 1.3): every tensor carries a step multiplier per position
    (``tensors[].row_codes``, ``code / 32``; the attention scope sets it from the attention the
    positions received during the prefill, when the capture recorded it).
    A header without a key means its kvz 0.1 value (sink off, file origin, float).
    """

    object_size: int = 256
    align: bool = False
    inter_map: bool = True
    blend: bool = False
    intra: bool = True
    channel_choice: bool = True
    rope_undo: bool = True
    lambdas: tuple = (0.5, 0.75)
    sink_tokens: int = 1
    sink_scale: float = 0.0625
    sink_origin: str = "absolute"
    arith: str = ""  # "" = auto: "exact", or "float" with align
    channel_steps: bool = False
    stale_window: int = 0
    stale_scale: float = 1.0
    row_steps: bool = False

    def __post_init__(self):
        scale = float(self.sink_scale)
        if not (isinstance(self.sink_tokens, int) and self.sink_tokens >= 0
                and 0.0 < scale <= 1.0 and float(np.float32(scale)) == scale):
            raise KvzError("sink_tokens must be >= 0 and sink_scale a float32 in (0, 1]")
        if self.sink_origin not in SINK_ORIGINS:
            raise KvzError(f"sink_origin must be one of {', '.join(SINK_ORIGINS)}")
        if not self.arith:
            object.__setattr__(self, "arith", "float" if self.align else "exact")
        if self.arith not in ARITHS:
            raise KvzError(f"arith must be one of {', '.join(ARITHS)}")
        if self.align and self.arith == "exact":
            raise KvzError("align (GPA rotations) needs arith='float' (format 1.0): the rotation back to the native "
                           "frame is a float product whose rounding varies between machines")
        stale = float(self.stale_scale)
        if not (isinstance(self.stale_window, int) and not isinstance(self.stale_window, bool)
                and self.stale_window >= 0 and 1.0 <= stale <= 256.0 and float(np.float32(stale)) == stale):
            raise KvzError("stale_window must be >= 0 and stale_scale a float32 in [1, 256]")
        if self.stale_window and self.arith != "exact":
            raise KvzError("stale_window (coarser steps for positions no query reads) needs exact arithmetic")
        if (self.channel_steps or self.row_steps) and self.arith != "exact":
            raise KvzError("channel_steps and row_steps (step multipliers) need exact arithmetic (format 1.1+)")
        if not (isinstance(self.object_size, int) and 2 <= self.object_size <= 1 << 16 and self.object_size % 2 == 0):
            raise KvzError("object_size must be an even integer in 2..65536")

    def to_json(self) -> dict:
        """The header form; keys at their kvz 0.1 meaning (file-relative sink, float arithmetic)
        are left out, so a file that needs nothing new stays readable by 0.1 (format 1.0)."""
        d = asdict(self)
        d["lambdas"] = list(self.lambdas)
        if self.sink_origin == "file":
            del d["sink_origin"]
        if self.arith == "float":
            del d["arith"]
        if not self.channel_steps:  # 1.3 switches: files without them stay readable by 1.1/1.2 readers
            del d["channel_steps"]
        if not self.stale_window:
            del d["stale_window"], d["stale_scale"]
        if not self.row_steps:
            del d["row_steps"]
        return d

    @classmethod
    def from_json(cls, d: dict) -> CodecConfig:
        d = dict(d)
        d["lambdas"] = tuple(d.get("lambdas", (0.5, 0.75)))
        d.setdefault("sink_tokens", 0)  # absent: files written before the sink option
        d.setdefault("sink_scale", 1.0)
        d.setdefault("sink_origin", "file")
        d.setdefault("arith", "float")
        return cls(**d)

    def sink_rows(self, start: int, position_offset: int) -> int:
        """How many rows from file position ``start`` lie in the sink."""
        origin = start + (position_offset if self.sink_origin == "absolute" else 0)
        return max(0, self.sink_tokens - origin)

    def stale_rows(self, start: int, layout, layer: int) -> int:
        """How many rows from file position ``start`` lie before layer ``layer``'s last window
        (0 unless ``stale_window`` is set and the layer is a sliding-window one)."""
        if not self.stale_window or "sliding" not in str(layout.layer_types[layer] if layout.layer_types else ""):
            return 0
        first_live = layout.n_tokens - (self.stale_window - 1)  # file position of the first attended row
        return max(0, first_live - start)

    def scale_stale(self, delta_rows: np.ndarray, start: int, layout, layer: int) -> None:
        """Multiply (float32, in place) the steps of the rows no later query attends
        (:meth:`stale_rows`); ``delta_rows[0]`` is file position ``start``."""
        k = min(len(delta_rows), self.stale_rows(start, layout, layer))
        if k > 0:
            delta_rows[:k] *= np.float32(self.stale_scale)

    def scale_sink(self, delta_rows: np.ndarray, start: int, position_offset: int = 0) -> None:
        """Multiply (in float32, in place) the steps of the rows in the sink; ``delta_rows[0]``
        is file position ``start``."""
        k = min(len(delta_rows), self.sink_rows(start, position_offset))
        if k > 0:
            delta_rows[:k] *= np.float32(self.sink_scale)
