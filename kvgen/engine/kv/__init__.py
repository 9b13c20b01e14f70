"""The KV cache: where every sequence's keys and values live between forward passes.

quant.py      torch quantizers (fp8, q4, q3), the bit-exact reference of the GPU kernels
formats.py    one storage format per KV_DTYPE behind one interface (allocate / write / read /
              release / take_block / put_block); make_format builds them
stage.py      ExactTail: a quantized format with each sequence's newest block and first token
              kept exact, presenting the same interface
calibrate.py  fitting a format from K/V samples (fp8 key scales, q3 codebooks)
pool.py       BlockPool: the blocks of one store, allocated and freed
paged.py      PagedKVCache: one sequence's block table and length
tiers.py      TieredKV: idle sequences' blocks moved out to host memory (warm) and disk (cold)

Nothing here imports the engine: the model feeds it K/V, engine/kv_samples.py runs the model
for calibration samples.
"""
