"""The FP8 KV cache's per-layer scales (`--kv-cache-dtype fp8_e4m3`): never a silent 1.0.

From the checkpoint when it has them (compressed-tensors' `kv_cache_scheme`: a scalar
`model.layers.N.self_attn.k_scale` / `v_scale`, or vLLM's other spelling `k_proj.output_scale` /
`v_proj.output_scale`), else calibrated once at start-up: the model runs in its own dtype over a
fixed English text (CALIBRATION_TEXT, tokenized by the model's tokenizer; a fixed random-token
sequence where the tokenizer cannot encode it), and each layer's scale is

    amax(K) / 448 * CALIBRATION_MARGIN    (and the same for V)

CALIBRATION_MARGIN = 2: a few hundred tokens do not see every outlier a server will, and a value
past 448 * scale saturates (clipped: its error is unbounded), while float8's relative precision is
the same in every binade: one binade of headroom only sends the very smallest values (below
2^-6 * scale) to subnormals a binade sooner. Deterministic: the same model, text and dtype give
the same scales, so a prefill and a decode server calibrate alike.
"""

from __future__ import annotations

import logging
import random

import torch

from pdserve.common.engine.attention.torch_native import TorchNativeBackend
from pdserve.common.engine.batch import ForwardBatch
from pdserve.common.engine.kv_pool import FP8_MAX, PagedKVPool, ReqToTokenPool
from pdserve.common.scheduling.batch import ForwardMode
from pdserve.common.scheduling.pages import pages_for

logger = logging.getLogger(__name__)

CALIBRATION_MARGIN = 2.0
CALIBRATION_TOKENS = 512  # at most: the text is cut (or the fallback drawn) to this many
MIN_CALIBRATION_TOKENS = 64  # fewer from the tokenizer: the random-token fallback instead

CALIBRATION_TEXT = (
    "The history of the lighthouse is a history of people trying to make the sea a little less dangerous. "
    "Long before electric lamps, sailors relied on fires lit on hilltops and towers near harbours. The "
    "ancient lighthouse of Alexandria, built on the island of Pharos more than two thousand years ago, was "
    "said to be visible from far out at sea, and its name still means lighthouse in several languages. "
    "Later towers burned wood, then coal, then candles and oil, and the keepers who tended them lived "
    "lonely lives on rocks and headlands, climbing the stairs every few hours to trim the wicks and clean "
    "the glass. In the nineteenth century the French engineer Augustin Fresnel designed a lens made of "
    "rings of glass prisms that bent the light into a narrow, powerful beam; a lamp that once lit a few "
    "miles of water could now be seen from twenty miles away. Each lighthouse was given its own pattern of "
    "flashes, so that a navigator who counted them could tell which coast lay ahead. Today most lights "
    "are automatic, satellites tell ships where they are to within a few metres, and many old towers have "
    "become museums or holiday cottages. Yet on a stormy night, when the radio fails and the rain hides "
    "the stars, a sailor who sees a familiar flash on the horizon still feels the same relief that sailors "
    "felt centuries ago. Questions people ask about them are simple: How tall is it? How far can the light "
    "be seen? Who lived there, and what did they eat in winter? The answers are written in logbooks, "
    "letters and the memories of families who kept the lights burning for three or four generations, "
    "through wars, shipwrecks and the slow arrival of the modern world."
)


def checkpoint_kv_scales(sources, num_layers: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """([L], [L]) fp32 K and V scales from the checkpoint's tensors, or None when it has none.

    `sources`: (file, tensors) pairs (models/loader.checkpoint_sources). A checkpoint with some of
    the scales but not all is refused: a layer left at 1.0 would be silently wrong.
    """
    found: dict[tuple[str, int], float] = {}
    for path, f in sources:
        for key in f.keys():
            kind = _scale_kind(key)
            if kind is None:
                continue
            layer = _layer_of(key)
            value = f.get_tensor(key).float()
            if value.numel() != 1 or not float(value) > 0:
                raise ValueError(f"{key!r} in {path}: a KV scale must be one positive number, got {value.tolist()}")
            found[(kind, layer)] = float(value)
    if not found:
        return None
    missing = [f"{kind}_scale of layer {n}" for kind in "kv" for n in range(num_layers) if (kind, n) not in found]
    if missing:
        raise ValueError(f"the checkpoint's KV cache scales lack {', '.join(missing[:4])}")
    return tuple(torch.tensor([found[(kind, n)] for n in range(num_layers)]) for kind in "kv")


def _scale_kind(key: str) -> str | None:
    for kind in "kv":
        if key.endswith((f".self_attn.{kind}_scale", f".{kind}_proj.output_scale")):
            return kind
    return None


def _layer_of(key: str) -> int:
    parts = key.split(".")
    for before, part in zip(parts, parts[1:]):
        if before in ("layers", "h") and part.isdigit():
            return int(part)
    raise ValueError(f"KV scale {key!r}: no layer number in its name")


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TEXT's token ids (at most CALIBRATION_TOKENS), or, where the tokenizer cannot
    encode it (none, or too few ids: a byte-less toy vocabulary), fixed random ids."""
    ids: list[int] = []
    if tokenizer is not None:
        try:
            ids = list(tokenizer(CALIBRATION_TEXT)["input_ids"])
        except Exception as e:  # a tokenizer that cannot encode plain English: use the fallback
            logger.warning("calibration text not tokenized (%s): random tokens instead", e)
    ids = [i for i in ids if 0 <= i < vocab_size]
    if len(ids) >= MIN_CALIBRATION_TOKENS:
        return ids[:CALIBRATION_TOKENS]
    rng = random.Random(0)
    return [rng.randrange(vocab_size) for _ in range(CALIBRATION_TOKENS)]


@torch.inference_mode()
def calibrate_kv_scales(model, ids: list[int], dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `model` once over `ids` in `dtype` into a scratch pool of that dtype (the torch-native
    backend: the same K and V on every device) and return each layer's K and V scale."""
    num_layers, kv_heads, head_dim = model.kv_geometry()
    n, page = len(ids), 16
    pool = PagedKVPool(1 + pages_for(n, page), page, num_layers, kv_heads, head_dim, dtype, device)
    rows = ReqToTokenPool(1, n, device)
    slots = torch.arange(page, page + n, dtype=torch.int64, device=device)  # page 0 stays reserved
    rows.req_to_token[0] = slots.to(torch.int32)
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND,
        reqs=[],
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.arange(n, dtype=torch.int64, device=device),
        out_cache_loc=slots,
        req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
        seq_lens=[n],
        extend_lens=[n],
        extend_starts=[0],
        req_rows=[0],
        last_indices=torch.tensor([n - 1], dtype=torch.int64, device=device),
        samples=[True],
        has_placeholders=False,
    )
    attn = TorchNativeBackend(rows, pool)
    attn.init_forward(batch)
    model(batch.input_ids, batch.positions, batch, attn)
    amax = [torch.stack([b.abs().amax().float() for b in bufs]) for bufs in (pool.k_buffers, pool.v_buffers)]
    # An all-zero layer (nothing to scale) keeps scale 1 rather than 0.
    return tuple(torch.where(a > 0, a / FP8_MAX * CALIBRATION_MARGIN, 1.0).cpu() for a in amax)


def log_scales(source: str, k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
    logger.info(
        "FP8 KV cache scales (%s, %d layers): K %.4g..%.4g, V %.4g..%.4g",
        source,
        k_scales.numel(),
        k_scales.min(),
        k_scales.max(),
        v_scales.min(),
        v_scales.max(),
    )
