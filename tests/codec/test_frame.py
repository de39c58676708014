"""The coding frame's RoPE arguments (Frame.rope_args), kept per table and row range."""
import numpy as np
from kvz_testing import sample_paths

from alignpred import KvzReader, compress, load_cache
from alignpred.cache.layout import Block


def test_rope_args_per_table_and_range(real_bank):
    """Layers that share a RoPE table get the same rows (made once per range); every layer's
    rows are its table's cos/sin for exactly those positions, for any start and length."""
    cache = load_cache(sample_paths()[0])
    data = compress(cache, None, budget=0.05, bank=real_bank).data
    dec = KvzReader(data, bank=real_bank).decoder
    lay, frame = dec.layout, dec.frame
    spec = lay.rope_spec
    for start, n in ((0, 448), (256, 192), (17, 5), (0, 448)):
        seen: dict = {}
        for layer in range(lay.num_layers):
            got = frame.rope_args(Block(layer, "K", 0), start, n)
            ix = spec.layer_table[layer]
            table = spec.tables[ix]
            cos, sin = table.cos_sin(start + lay.position_offset, n)
            s = np.float32(table.attention_scaling)
            assert got[2:] == (table.rotary_dim, table.pairing)
            assert np.array_equal(got[0], cos * s) and np.array_equal(got[1], sin * s)
            if ix in seen:
                assert got[0] is seen[ix][0] and got[1] is seen[ix][1]
            seen[ix] = got
        assert frame.rope_args(Block(0, "V", 0), start, n) is None
