// Runs CUDA C++ kernels on the CPU, for the tests: tests/support/cuda_emulator.py puts this
// file before a kernel source and compiles both with g++.
//
// A launch runs its blocks one after another. Each thread of a block is a coroutine
// (ucontext) with its own stack, so its local variables are its own; `__shared__`
// variables become function statics, one copy that every thread of the running block
// sees. Threads run in turn until they finish or wait: at __syncthreads until every live
// thread of the block waits there, at a warp shuffle until every live lane of the warp
// has put its value down. Nothing runs concurrently, so atomics are plain reads and
// writes. A wait that can never be released (threads of one warp at different barriers)
// ends the launch with an error instead of hanging.
//
// Floating point: g++ is run with -ffp-contract=off, so a * b + c rounds twice here where
// nvcc may fuse it; the tests compare with the tolerances they use on a GPU.

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
  unsigned x, y, z;
};
using dim3 = uint3;
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(8))) float2 {
  float x, y;
};

namespace emu {

enum State { RUNNING, AT_SYNCTHREADS, AT_WARP, DONE };

struct Thread {
  ucontext_t context;
  uint3 index;
  int linear;  // x + y * bx + z * bx * by: its warp is linear / 32
  State state;
};

constexpr size_t STACK_BYTES = 64 * 1024;

inline std::vector<Thread> threads;
inline std::vector<char> stacks;
inline ucontext_t scheduler;
inline Thread* current = nullptr;
inline uint3 block_index, block_dim, grid_dim;
inline unsigned long long lanes[1024];  // each thread's value in a shuffle
inline void (*body)(void*) = nullptr;
inline void* body_args = nullptr;

inline void wait(State why) {
  current->state = why;
  swapcontext(&current->context, &scheduler);
}

inline void thread_main() {
  body(body_args);
  current->state = DONE;  // uc_link returns to the scheduler
}

// The live threads of warp w all wait at a shuffle (or there are none).
inline bool warp_ready(int w, int n) {
  bool any = false;
  for (int i = w * 32; i < n && i < (w + 1) * 32; ++i) {
    if (threads[i].state == DONE) continue;
    if (threads[i].state != AT_WARP) return false;
    any = true;
  }
  return any;
}

// Run one block to its end; false when it can make no progress.
inline bool run_block(int n) {
  for (;;) {
    bool ran = false, live = false;
    for (int i = 0; i < n; ++i) {
      if (threads[i].state == RUNNING) {
        current = &threads[i];
        swapcontext(&scheduler, &threads[i].context);
        ran = true;
      }
      live |= threads[i].state != DONE;
    }
    if (!live) return true;
    if (ran) continue;
    bool released = false;
    for (int w = 0; w * 32 < n; ++w) {
      if (!warp_ready(w, n)) continue;
      for (int i = w * 32; i < n && i < (w + 1) * 32; ++i)
        if (threads[i].state == AT_WARP) threads[i].state = RUNNING;
      released = true;
    }
    if (released) continue;
    bool all = true;
    for (int i = 0; i < n; ++i) all &= threads[i].state == DONE || threads[i].state == AT_SYNCTHREADS;
    if (!all) return false;
    for (int i = 0; i < n; ++i)
      if (threads[i].state == AT_SYNCTHREADS) threads[i].state = RUNNING;
  }
}

// Every block of the grid, one after the other. 0, or 1 for a block that deadlocked,
// 2 for a block of more than 1024 threads.
inline int run(uint3 grid, uint3 block, void (*f)(void*), void* args) {
  const int n = block.x * block.y * block.z;
  if (n > 1024 || n < 1) return 2;
  if (stacks.size() < n * STACK_BYTES) stacks.resize(n * STACK_BYTES);
  threads.resize(n);
  grid_dim = grid;
  block_dim = block;
  body = f;
  body_args = args;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        block_index = {bx, by, bz};
        for (int i = 0; i < n; ++i) {
          Thread& t = threads[i];
          t.linear = i;
          t.index = {(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                     (unsigned)(i / (block.x * block.y))};
          t.state = RUNNING;
          getcontext(&t.context);
          t.context.uc_stack.ss_sp = stacks.data() + i * STACK_BYTES;
          t.context.uc_stack.ss_size = STACK_BYTES;
          t.context.uc_link = &scheduler;
          makecontext(&t.context, thread_main, 0);
        }
        if (!run_block(n)) return 1;
      }
  return 0;
}

template <class T>
T shuffle(T v, int source_lane) {
  static_assert(sizeof(T) <= sizeof(unsigned long long));
  const int lane = current->linear & 31, base = current->linear - lane;
  std::memcpy(&lanes[current->linear], &v, sizeof(T));
  wait(AT_WARP);  // every lane's value is down
  T out = v;
  if (source_lane >= 0 && source_lane < 32 && base + source_lane < (int)threads.size())
    std::memcpy(&out, &lanes[base + source_lane], sizeof(T));
  wait(AT_WARP);  // every lane has read before the next shuffle writes
  return out;
}

template <class... A, size_t... I>
void call(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}

// Launch kernel f with its arguments at args[i] (each a pointer to the value).
template <class... A>
int launch(void (*f)(A...), unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
           unsigned bz, void** args) {
  struct Call {
    void (*f)(A...);
    void** args;
  } c{f, args};
  return run({gx, gy, gz}, {bx, by, bz},
             [](void* p) {
               auto* c = static_cast<Call*>(p);
               call(c->f, c->args, std::index_sequence_for<A...>{});
             },
             &c);
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
#define threadIdx (emu::current->index)
#define blockIdx (emu::block_index)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::wait(emu::AT_SYNCTHREADS); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::wait(emu::AT_WARP); }
template <class T>
T __shfl_xor_sync(unsigned, T v, int mask) {
  return emu::shuffle(v, (emu::current->linear & 31) ^ mask);
}
template <class T>
T __shfl_down_sync(unsigned, T v, int delta) {
  const int lane = emu::current->linear & 31;
  return emu::shuffle(v, lane + delta < 32 ? lane + delta : lane);
}
template <class T>
T __shfl_sync(unsigned, T v, int source) {
  return emu::shuffle(v, source & 31);
}

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __expf(float x) { return std::exp(x); }
template <class T>
T __ldg(const T* p) { return *p; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
template <class T>
T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }
template <class T>
T atomicMax(T* p, T v) { const T old = *p; if (v > old) *p = v; return old; }
template <class T>
T atomicMin(T* p, T v) { const T old = *p; if (v < old) *p = v; return old; }
template <class T>
T atomicCAS(T* p, T expected, T v) { const T old = *p; if (old == expected) *p = v; return old; }
