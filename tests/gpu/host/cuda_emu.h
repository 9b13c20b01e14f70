// Host emulation of the CUDA built-ins the kvgen kernels use, so that g++ compiles the real
// kernels/*.cu and the tests run them on CPU tensors (see emu_launchers.cpp).
//
// The threads of a block are fibers (ucontext) on one OS thread, run round-robin; __syncthreads
// and warp shuffles are barriers that yield until every thread of the block / warp has arrived.
// Blocks run one after another.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <math.h>
#include <string.h>
#include <vector>

#define __CUDACC__ 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct kvg_dim3 { unsigned x, y, z; };
static kvg_dim3 threadIdx, blockIdx, blockDim, gridDim;
using std::max;
using std::min;

struct EmuFiber { ucontext_t ctx; bool done; std::vector<char> stack; };
static std::vector<EmuFiber> emu_fibers;
static ucontext_t emu_sched;
static unsigned emu_cur;
struct EmuBarrier { unsigned count = 0, gen = 0; };
static EmuBarrier emu_block_bar, emu_warp_bar[32];
static unsigned emu_warp_words[32][32];

static void emu_yield() { swapcontext(&emu_fibers[emu_cur].ctx, &emu_sched); }

// Arrive at b; the n-th arrival opens it (a new generation), the others yield until then.
static void emu_wait(EmuBarrier& b, unsigned n) {
  const unsigned g = b.gen;
  if (++b.count == n) { b.count = 0; ++b.gen; return; }
  while (b.gen == g) emu_yield();
}

inline void __syncthreads() { emu_wait(emu_block_bar, blockDim.x); }

// Lane src's v (int or float, as the CUDA overloads): every lane publishes its value, then
// every lane reads before anyone writes again.
template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  static_assert(sizeof(T) == 4, "int and float lanes");
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  memcpy(&emu_warp_words[warp][lane], &v, 4);
  emu_wait(emu_warp_bar[warp], 32);
  T r;
  memcpy(&r, &emu_warp_words[warp][(unsigned)src & 31u], 4);
  emu_wait(emu_warp_bar[warp], 32);
  return r;
}

inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask) {
  return __shfl_sync(mask, v, (int)((threadIdx.x & 31u) ^ (unsigned)lane_mask));
}

inline void __syncwarp() { emu_wait(emu_warp_bar[threadIdx.x >> 5], 32); }

static void (*emu_body)(void*);
static void* emu_body_arg;
static void emu_entry() {
  emu_body(emu_body_arg);
  emu_fibers[emu_cur].done = true;
}

// Run body as every thread of a gx * gy * gz grid of `threads`-thread blocks.
template <class F>
static void emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, F body) {
  blockDim = {threads, 1, 1};
  gridDim = {gx, gy, gz};
  emu_fibers.assign(threads, EmuFiber{});
  emu_body = [](void* p) { (*(F*)p)(); };
  emu_body_arg = &body;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) {
        blockIdx = {x, y, z};
        emu_block_bar = EmuBarrier{};
        for (auto& w : emu_warp_bar) w = EmuBarrier{};
        for (unsigned t = 0; t < threads; ++t) {
          EmuFiber& f = emu_fibers[t];
          f.done = false;
          f.stack.resize(1 << 16);
          getcontext(&f.ctx);
          f.ctx.uc_stack.ss_sp = f.stack.data();
          f.ctx.uc_stack.ss_size = f.stack.size();
          f.ctx.uc_link = &emu_sched;
          makecontext(&f.ctx, emu_entry, 0);
        }
        for (unsigned live = threads; live;) {  // round-robin until every thread returned
          live = 0;
          for (unsigned t = 0; t < threads; ++t) {
            if (emu_fibers[t].done) continue;
            emu_cur = t;
            threadIdx = {t, 0, 0};
            swapcontext(&emu_sched, &emu_fibers[t].ctx);
            live += !emu_fibers[t].done;
          }
        }
      }
}
