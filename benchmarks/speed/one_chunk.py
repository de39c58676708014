"""One chunk: the decode of one object range (one ``object_size``-token chunk, 256 tokens by default,
of every layer's K and V) of a held-out cache through the public API, ``KvzReader(data, bank=,
threads=t).read(tokens=(a, b))`` on a reader opened once, at 1 and 2 threads (the reader splits one
range's exact map products by rows over its threads), interleaved rounds; ms per chunk and the
speed-up. The chunk is the middle one of the cache (not the first, whose attention-sink tokens are
atypical); its bits are checked against the same tokens of a full one-thread read, for every thread
count."""
from __future__ import annotations

from ..harness import Op, run_interleaved, timing
from .codecs import KvzCodec
from .config import CHUNK_THREADS, EPS, WARM_S, log
from .measures import arrays_digest


def chunk_range(n_tokens: int, object_size: int) -> tuple[int, int]:
    """The token range of the middle object of an ``n_tokens``-token file."""
    n = -(-n_tokens // object_size)
    j = n // 2
    return j * object_size, min(n_tokens, (j + 1) * object_size)


def chunk_section(name: str, cache, bank, *, threads=CHUNK_THREADS, rounds: int = 5, eps: float = EPS,
                  progress: bool = True) -> dict:
    """ms per chunk (wall and CPU medians over ``rounds`` interleaved rounds) for each thread count,
    the speed-up of each over one thread (wall), and whether every thread count gives the same bits."""
    c = KvzCodec(cache, bank, eps)
    c.encode(max(threads))
    readers = {th: c.reader(th) for th in threads}
    r1 = readers[min(threads)]
    a, b = chunk_range(r1.layout.n_tokens, r1.config.object_size)
    full = c.decode(1)
    want = arrays_digest({k: v[..., a:b, :] for k, v in full.items()})
    n_values = int(sum(v[..., a:b, :].size for v in full.values()))
    del full
    digests = {str(th): arrays_digest(r.read(tokens=(a, b))) for th, r in readers.items()}  # also the warm-up

    def reads(r):
        return lambda: r.read(tokens=(a, b))

    ops = [Op("kvz", "decode_chunk", th, reads(r)) for th, r in readers.items()]
    run_interleaved(ops, rounds, label=f"{name} one chunk" if progress else "", log=log, warm_s=WARM_S)
    times = {str(op.threads): timing(op.walls, op.cpus) for op in ops}
    ms = {k: 1e3 * t["wall_s"] for k, t in times.items()}
    t1 = times[str(min(threads))]["wall_s"]
    res = {"cache": name, "tokens": [a, b], "object_size": r1.config.object_size, "n_values": n_values,
           "bytes_file": c.nbytes(), "eps": eps, "rounds": rounds, "times": times, "ms_per_chunk": ms,
           "ms_per_chunk_cpu": {k: 1e3 * t["cpu_s"] for k, t in times.items()},
           "speedup": {k: t1 / t["wall_s"] if t["wall_s"] > 0 else float("inf") for k, t in times.items()},
           "digests": digests, "identical": len(set(digests.values())) == 1 and want in digests.values()}
    log(f"one chunk {a}:{b} of {name}: " + ", ".join(f"{k} thread(s) {v:.1f} ms" for k, v in ms.items()))
    return res

