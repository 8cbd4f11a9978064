// cuda-emu: run CUDA C kernels on the CPU with g++ (test-only; see runtimes/cuda/emu.py).
//
// Maps the CUDA C subset our kernels use onto C++20: __global__/__device__ become plain functions, the built-in
// indices are thread_local, __shared__ variables are function statics (blocks run one at a time, so a static is
// exactly "one copy per block"). A kernel without barriers or warp shuffles runs its threads as a plain loop;
// the others get one std::thread per CUDA thread, a std::barrier per block (__syncthreads) and one per warp
// (shuffles exchange values through a per-warp buffer between two warp barriers). A barrier or a shuffle in a
// kernel launched as a loop aborts with a message (the kernel was declared barrier-free by mistake).
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

namespace emu {
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "cuda-emu: %s\n", what);
  std::abort();
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

template <class T>
inline T shuffle(T v, int src) {
  static_assert(sizeof(T) <= 8, "shuffle of a value wider than 8 bytes");
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
  if (!emu::ctx) emu::fail("__syncthreads in a kernel launched as a plain loop (declare it with barriers)");
  emu::ctx->block->arrive_and_wait();
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  if (!emu::ctx) emu::fail("__syncwarp in a kernel launched as a plain loop (declare it with barriers)");
  emu::ctx->warp->bar.arrive_and_wait();
}
template <class T>
inline T __shfl_sync(unsigned, T v, int src, int = 32) { return emu::shuffle(v, src & 31); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int = 32) {
  return emu::shuffle(v, emu::ctx ? (emu::ctx->lane ^ mask) : 0);
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned d, int = 32) {
  int src = emu::ctx ? emu::ctx->lane + int(d) : 0;
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
// Run `kernel(args)` (one CUDA thread) over the launch's grid; `sync`: the kernel uses barriers or warp shuffles,
// so its threads must run concurrently. Not a template: a module compiles this machinery once, not per kernel.
using KernelFn = void (*)(void* const* args);
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
