"""Speed: where decode time goes, and what would buy more of it.

:mod:`.kernels_bench` (the map and rANS kernels), :mod:`.amx_decode` and :mod:`.amx_mix` (the AMX map
kernel), :mod:`.entropy_decode` (rans4, lanes32 and a C lanes32 decoder; ``--study``),
:mod:`.map_rank` and :mod:`.map_sources` (bits against multiply-adds of the maps), :mod:`.loader`
(chunks into preallocated buffers), :mod:`.startup` (a fresh process's start-up)."""
