// The real kvgen kernels compiled by g++ for the host (cuda_emu.h stands in for the CUDA
// built-ins), with one C launcher per kernel family: the tests pass a kernel's address (looked
// up by its exported name), the grid and block size, then the kernel's own arguments.
// Built with -ffp-contract=off: the host then rounds like the device's append kernels, which
// have no multiply-add to contract.
#include "cuda_emu.h"

#include "kv_append.cu"
#include "flash_decode.cu"

typedef void (*append_fn)(KVG_APPEND_PARAMS);
typedef void (*split_fn)(KVG_SPLIT_PARAMS);
typedef void (*reduce_fn)(const float*, const float*, void*, int, int, int);
typedef void (*incr_fn)(int*, const u8*, int, int, int);

extern "C" {
void emu_append(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, KVG_APPEND_PARAMS) {
  emu_launch(gx, gy, gz, threads, [&] {
    ((append_fn)f)(KVG_APPEND_ARGNAMES);
  });
}

void emu_split(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, KVG_SPLIT_PARAMS) {
  emu_launch(gx, gy, gz, threads, [&] {
    ((split_fn)f)(KVG_SPLIT_ARGNAMES);
  });
}

void emu_reduce(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, const float* part_acc,
                const float* part_ml, void* out, int H, int HD, int S) {
  emu_launch(gx, gy, gz, threads, [&] { ((reduce_fn)f)(part_acc, part_ml, out, H, HD, S); });
}

void emu_increment(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned threads, int* seq_lens,
                   const u8* valid, int has_valid, int B, int n) {
  emu_launch(gx, gy, gz, threads, [&] { ((incr_fn)f)(seq_lens, valid, has_valid, B, n); });
}
}
