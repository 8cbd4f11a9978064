// cuda-emu: run CUDA C kernels on the CPU with g++ (test-only; see runtimes/cuda/emu.py).
//
// Maps the CUDA C subset our kernels use onto C++20: __global__/__device__ become plain functions, the built-in
// indices are thread_local, __shared__ variables are function statics (blocks run one at a time, so a static is
// exactly "one copy per block"). A kernel without barriers or warp shuffles runs its threads as a plain loop;
// the others get one std::thread per CUDA thread, a std::barrier per block (__syncthreads) and one per warp
// (shuffles exchange values through a per-warp buffer between two warp barriers). A barrier or a shuffle in a
// kernel launched as a loop aborts with a message (the kernel was declared barrier-free by mistake).
// Threads need not be OS threads: outside the sanitizers, a block's CUDA threads are fibers on the calling thread
// (a context switch at each barrier or shuffle, the threads of a block run in order between barriers), which is
// ~100x faster than OS threads on a few cores; under -fsanitize=address/thread they are std::threads, so the
// sanitizers see real threads and stacks.
// half, bfloat16 and fp8 are 16/8-bit structs with the conversions CUDA has, rounding to nearest even exactly as
// the device does (checked against ml_dtypes bit for bit in tests/runtimes/test_cuda_emu.py).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) alignas(n)

using std::max;
using std::min;
using std::signbit;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
typedef dim3 uint3;

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;
static constexpr int warpSize = 32;

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LR_EMU_FIBERS 0
#else
#define LR_EMU_FIBERS 1
#endif
#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace emu {
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda-emu: %s\n", what);
  std::abort();
}

// ---- fibers: a block's CUDA threads on the calling OS thread --------------------------------------------------
using KernelFn = void (*)(void* const* args);
enum FiberState { RUNNABLE, AT_BLOCK, AT_WARP, DONE };
struct Fiber {
  void* sp = nullptr;  // saved stack pointer while switched out
#if !defined(__x86_64__)
  ucontext_t uc;
#endif
  FiberState state = RUNNABLE;
};
struct FiberBlock {
  std::vector<Fiber> fibers;
  std::vector<char*> stacks;
  void* sched_sp = nullptr;
#if !defined(__x86_64__)
  ucontext_t sched_uc;
#endif
  unsigned n = 0, current = 0, at_block = 0, done = 0;
  unsigned at_warp[32] = {}, done_warp[32] = {};
  unsigned long long slot[32][32];  // shuffle values, per warp and lane
  KernelFn kernel = nullptr;
  void* const* args = nullptr;
};
inline thread_local FiberBlock* fiber_block = nullptr;  // set while a block runs as fibers
constexpr std::size_t FIBER_STACK = 256 * 1024;

#if defined(__x86_64__)
// Save the callee-saved registers, MXCSR and the x87 control word on this stack, store the stack pointer in
// *save, switch to `to` and restore what was saved there (the System V x86-64 ABI's callee-saved state).
__attribute__((naked, noinline)) static void switch_stack(void** /*save*/, void* /*to*/) {
  asm volatile(
      "pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
      "subq $8, %rsp\n stmxcsr (%rsp)\n fnstcw 4(%rsp)\n"
      "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
      "ldmxcsr (%rsp)\n fldcw 4(%rsp)\n addq $8, %rsp\n"
      "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
}
#endif

[[noreturn]] inline void fiber_main() {
  FiberBlock& b = *fiber_block;
  b.kernel(b.args);
  Fiber& f = b.fibers[b.current];
  f.state = DONE;
  b.done++;
  b.done_warp[b.current / 32]++;
#if defined(__x86_64__)
  switch_stack(&f.sp, b.sched_sp);
#else
  swapcontext(&f.uc, &b.sched_uc);
#endif
  fail("a finished fiber was resumed");
}

inline void to_scheduler(Fiber& f) {
  FiberBlock& b = *fiber_block;
#if defined(__x86_64__)
  switch_stack(&f.sp, b.sched_sp);
#else
  swapcontext(&f.uc, &b.sched_uc);
#endif
}

inline void fiber_wait(FiberState kind) {  // a barrier: back to the scheduler until it releases this one
  FiberBlock& b = *fiber_block;
  Fiber& f = b.fibers[b.current];
  f.state = kind;
  if (kind == AT_BLOCK)
    b.at_block++;
  else
    b.at_warp[b.current / 32]++;
  to_scheduler(f);
}
struct Warp {
  explicit Warp(std::ptrdiff_t lanes) : bar(lanes) {}
  std::barrier<> bar;
  unsigned long long slot[32];
};
struct ThreadCtx {
  std::barrier<>* block = nullptr;
  Warp* warp = nullptr;
  int lane = 0;
};
inline thread_local ThreadCtx* ctx = nullptr;

inline int lane() {
  return fiber_block ? int(fiber_block->current % 32) : (ctx ? ctx->lane : 0);
}

template <class T>
inline T shuffle(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
  if (fiber_block) {
    FiberBlock& b = *fiber_block;
    unsigned w = b.current / 32;
    std::memcpy(&b.slot[w][b.current % 32], &v, sizeof(T));
    fiber_wait(AT_WARP);
    T r = v;
    if (src >= 0 && src < 32) std::memcpy(&r, &b.slot[w][src], sizeof(T));
    fiber_wait(AT_WARP);  // nobody overwrites a slot before every lane has read
    return r;
  }
  if (!ctx) fail("warp shuffle in a kernel launched as a plain loop (declare it with barriers)");
  Warp& w = *ctx->warp;
  std::memcpy(&w.slot[ctx->lane], &v, sizeof(T));
  w.bar.arrive_and_wait();
  T r = v;
  if (src >= 0 && src < 32) std::memcpy(&r, &w.slot[src], sizeof(T));
  w.bar.arrive_and_wait();  // nobody overwrites a slot before every lane has read
  return r;
}
}  // namespace emu

inline void __syncthreads() {
  if (emu::fiber_block) return emu::fiber_wait(emu::AT_BLOCK);
  if (!emu::ctx) emu::fail("__syncthreads in a kernel launched as a plain loop (declare it with barriers)");
  emu::ctx->block->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  if (emu::fiber_block) return emu::fiber_wait(emu::AT_WARP);
  if (!emu::ctx) emu::fail("__syncwarp in a kernel launched as a plain loop (declare it with barriers)");
  emu::ctx->warp->bar.arrive_and_wait();
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) { return emu::shuffle(v, src & 31); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return emu::shuffle(v, emu::lane() ^ mask);
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
  int src = emu::lane() + int(d);
  return emu::shuffle(v, src < 32 ? src : -1);
}

template <class T>
inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T>
inline T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (old < v && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
inline T __ldg(const T* p) { return *p; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }

// ---- narrow floats: storage structs and round-to-nearest-even conversions ------------------------------------
namespace emu {
inline uint32_t bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float from_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// f32 -> a small float format with `man` mantissa bits, minimum normal exponent `emin`, largest finite `max`;
// `has_inf`: overflow gives inf (IEEE-like), else NaN (e4m3fn). Exact: every step is a power-of-two scaling or
// a rint (round half to even) of a value that fits a double. Returns (sign, exponent field, mantissa) packed.
inline uint32_t encode(float x, int ebits, int man, int emin, double maxv, bool has_inf, uint32_t nan) {
  uint32_t sign = (bits(x) >> 31) << (ebits + man);
  if (std::isnan(x)) return nan;
  double a = std::fabs(double(x));
  if (a == 0.0) return sign;
  int e;
  std::frexp(a, &e);  // a = f * 2^e, f in [0.5, 1): exponent of a is e - 1
  int exp = std::max(e - 1, emin);
  double q = std::ldexp(1.0, exp - man);
  double r = std::rint(a / q) * q;
  uint32_t inf_or_nan = has_inf ? (((1u << ebits) - 1) << man) : nan;
  if (r > maxv || std::isinf(a)) return has_inf ? (sign | inf_or_nan) : nan;
  if (r < std::ldexp(1.0, emin)) return sign | uint32_t(r / std::ldexp(1.0, emin - man));  // subnormal
  std::frexp(r, &e);
  int bias = (1 << (ebits - 1)) - 1;
  uint32_t m = uint32_t(r / std::ldexp(1.0, e - 1 - man)) - (1u << man);
  return sign | (uint32_t(e - 1 + bias) << man) | m;
}
inline float decode(uint32_t v, int ebits, int man, bool ieee_special) {
  uint32_t s = (v >> (ebits + man)) & 1, ef = (v >> man) & ((1u << ebits) - 1), m = v & ((1u << man) - 1);
  int bias = (1 << (ebits - 1)) - 1;
  float sign = s ? -1.0f : 1.0f;
  if (ieee_special && ef == (1u << ebits) - 1) return m ? NAN : sign * INFINITY;
  if (!ieee_special && ef == (1u << ebits) - 1 && m == (1u << man) - 1) return NAN;  // e4m3fn: S.1111.111
  if (ef == 0) return sign * std::ldexp(float(m), 1 - bias - man);
  return sign * std::ldexp(float(m | (1u << man)), int(ef) - bias - man);
}
}  // namespace emu

struct __half {
  unsigned short __x;
};
struct __nv_bfloat16 {
  unsigned short __x;
};
typedef unsigned char __nv_fp8_storage_t;
struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
};
struct __nv_fp8_e5m2 {
  __nv_fp8_storage_t __x;
};
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

inline __half __float2half_rn(float x) {
  // CUDA gives the canonical NaN 0x7fff for any NaN input
  return __half{(unsigned short)emu::encode(x, 5, 10, -14, 65504.0, true, 0x7fffu)};
}
inline float __half2float(__half h) { return emu::decode(h.__x, 5, 10, true); }
inline __nv_bfloat16 __float2bfloat16_rn(float x) {
  uint32_t u = emu::bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fffu};
  u += 0x7fffu + ((u >> 16) & 1u);  // round half to even on the dropped 16 bits (overflow carries into inf)
  return __nv_bfloat16{(unsigned short)(u >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) { return emu::from_bits(uint32_t(b.__x) << 16); }
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
  if (kind == __NV_E4M3) {
    if (sat == __NV_SATFINITE && !std::isnan(x)) x = std::clamp(x, -448.0f, 448.0f);
    return (__nv_fp8_storage_t)emu::encode(x, 4, 3, -6, 448.0, false, 0x7fu);
  }
  if (sat == __NV_SATFINITE && !std::isnan(x)) x = std::clamp(x, -57344.0f, 57344.0f);
  return (__nv_fp8_storage_t)emu::encode(x, 5, 2, -14, 57344.0, true, 0x7fu);
}
// the emulator decodes fp8 straight to f32 (exact, as fp8 -> half -> f32 is on the device)
inline float lr_emu_fp8_to_f32(__nv_fp8_storage_t v, __nv_fp8_interpretation_t kind) {
  return kind == __NV_E4M3 ? emu::decode(v, 4, 3, false) : emu::decode(v, 5, 2, true);
}

// ---- launching ------------------------------------------------------------------------------------------------
struct EmuLaunch {
  unsigned grid[3];
  unsigned block[3];
};

namespace emu {
inline void set_thread(unsigned t) {
  threadIdx.x = t % blockDim.x;
  threadIdx.y = (t / blockDim.x) % blockDim.y;
  threadIdx.z = t / (blockDim.x * blockDim.y);
}
template <class F>
inline void for_blocks(F&& body) {
  for (unsigned z = 0; z < gridDim.z; ++z)
    for (unsigned y = 0; y < gridDim.y; ++y)
      for (unsigned x = 0; x < gridDim.x; ++x) {
        blockIdx.x = x, blockIdx.y = y, blockIdx.z = z;
        body();
      }
}
// One block of `n` CUDA threads as fibers: each runs until it reaches a barrier (or ends); a barrier is released
// once every thread of its block (or warp) has reached it or ended - an ended thread counts as arrived, as the
// threaded path's end-of-block barrier does. Threads run in order between barriers.
inline void run_block_fibers(FiberBlock& b) {
  for (unsigned t = 0; t < b.n; ++t) {
    Fiber& f = b.fibers[t];
    f.state = RUNNABLE;
#if defined(__x86_64__)
    auto top = reinterpret_cast<std::uintptr_t>(b.stacks[t] + FIBER_STACK) & ~std::uintptr_t(15);
    void** sp = reinterpret_cast<void**>(top);
    *--sp = nullptr;                                    // fiber_main's return address (never used)
    *--sp = reinterpret_cast<void*>(&fiber_main);       // where switch_stack's `ret` goes
    for (int r = 0; r < 6; ++r) *--sp = nullptr;        // rbp rbx r12 r13 r14 r15
    *--sp = reinterpret_cast<void*>(std::uintptr_t(__builtin_ia32_stmxcsr()) | (std::uintptr_t(0x037F) << 32));
    f.sp = sp;
#else
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = b.stacks[t];
    f.uc.uc_stack.ss_size = FIBER_STACK;
    f.uc.uc_link = nullptr;
    makecontext(&f.uc, reinterpret_cast<void (*)()>(&fiber_main), 0);
#endif
  }
  b.at_block = b.done = 0;
  for (unsigned w = 0; w < 32; ++w) b.at_warp[w] = b.done_warp[w] = 0;
  while (b.done < b.n) {
    bool ran = false, released = false;
    for (unsigned t = 0; t < b.n; ++t) {
      if (b.fibers[t].state != RUNNABLE) continue;
      b.current = t;
      set_thread(t);
#if defined(__x86_64__)
      switch_stack(&b.sched_sp, b.fibers[t].sp);
#else
      swapcontext(&b.sched_uc, &b.fibers[t].uc);
#endif
      ran = true;
    }
    if (b.at_block && b.at_block + b.done == b.n) {
      for (unsigned t = 0; t < b.n; ++t)
        if (b.fibers[t].state == AT_BLOCK) b.fibers[t].state = RUNNABLE;
      b.at_block = 0;
      released = true;
    }
    for (unsigned w = 0; w * 32 < b.n; ++w) {
      unsigned lanes = std::min(32u, b.n - 32 * w);
      if (b.at_warp[w] && b.at_warp[w] + b.done_warp[w] == lanes) {
        for (unsigned t = 32 * w; t < 32 * w + lanes; ++t)
          if (b.fibers[t].state == AT_WARP) b.fibers[t].state = RUNNABLE;
        b.at_warp[w] = 0;
        released = true;
      }
    }
    if (!ran && !released && b.done < b.n) fail("a barrier that not every thread of the block reaches (deadlock)");
  }
}

// Run `kernel(args)` (one CUDA thread) over the launch's grid; `sync`: the kernel uses barriers or warp shuffles,
// so its threads must run concurrently. Not a template: a module compiles this machinery once, not per kernel.
inline void run(const EmuLaunch* L, KernelFn kernel, void* const* args, bool sync) {
  gridDim = dim3{L->grid[0], L->grid[1], L->grid[2]};
  blockDim = dim3{L->block[0], L->block[1], L->block[2]};
  unsigned n = blockDim.x * blockDim.y * blockDim.z;
  if (n == 0 || gridDim.x * gridDim.y * gridDim.z == 0) return;
  if (!sync) {
    for_blocks([&] {
      for (unsigned t = 0; t < n; ++t) {
        set_thread(t);
        kernel(args);
      }
    });
    return;
  }
#if LR_EMU_FIBERS
  {
    static thread_local FiberBlock b;  // stacks kept from launch to launch
    if (b.stacks.size() < n) {
      for (std::size_t t = b.stacks.size(); t < n; ++t) b.stacks.push_back(static_cast<char*>(std::malloc(FIBER_STACK)));
      b.fibers.resize(n);
    }
    b.n = n;
    b.kernel = kernel;
    b.args = args;
    fiber_block = &b;
    for_blocks([&] { run_block_fibers(b); });
    fiber_block = nullptr;
    return;
  }
#endif
  std::barrier<> block(n);
  std::vector<std::unique_ptr<Warp>> warps;
  for (unsigned w = 0; w < (n + 31) / 32; ++w) warps.emplace_back(new Warp(std::min(32u, n - 32 * w)));
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (unsigned t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {  // gridDim/blockDim were set before the threads started: only read here
      ThreadCtx c{&block, warps[t / 32].get(), int(t % 32)};
      ctx = &c;
      set_thread(t);
      for_blocks([&] {
        kernel(args);
        block.arrive_and_wait();  // the next block reuses the statics (shared memory): wait for every thread
      });
      ctx = nullptr;
    });
  }
  for (auto& th : threads) th.join();
}
}  // namespace emu
