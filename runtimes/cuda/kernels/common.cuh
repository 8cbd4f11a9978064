// Shared device helpers: storage types, f32 conversions, reductions. Compiled by NVRTC (GPU) and by g++ through
// emu.h (cuda-emu). Every kernel computes in f32 (integers in their own type) and converts at loads and stores.
#pragma once
#ifdef LUMINAL_EMU
#include "emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

#define LR_DEV __device__ __forceinline__

typedef __half f16;
typedef __nv_bfloat16 bf16;
typedef __nv_fp8_e4m3 f8e4m3;
typedef __nv_fp8_e5m2 f8e5m2;
typedef unsigned char u8;
// FP4 (E2M1) held one code per byte, as ml_dtypes' float4_e2m1fn arrays are (packed NVFP4 weights are u8)
struct f4e2m1 {
  unsigned char __x;
};

// ---- conversions (round to nearest even; f32 -> f8e4m3 overflow gives NaN, as ml_dtypes and the reference) --
LR_DEV float to_f32(float v) { return v; }
LR_DEV float to_f32(f16 v) { return __half2float(v); }
LR_DEV float to_f32(bf16 v) { return __bfloat162float(v); }
#ifdef LUMINAL_EMU
LR_DEV float to_f32(f8e4m3 v) { return lr_emu_fp8_to_f32(v.__x, __NV_E4M3); }
LR_DEV float to_f32(f8e5m2 v) { return lr_emu_fp8_to_f32(v.__x, __NV_E5M2); }
#else
LR_DEV float to_f32(f8e4m3 v) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.__x, __NV_E4M3))); }
LR_DEV float to_f32(f8e5m2 v) { return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.__x, __NV_E5M2))); }
#endif
LR_DEV float to_f32(int v) { return (float)v; }
LR_DEV float to_f32(u8 v) { return (float)v; }
LR_DEV float to_f32(bool v) { return v ? 1.0f : 0.0f; }
LR_DEV float to_f32(f4e2m1 v) {
  const unsigned m = v.__x & 7u;  // magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
  const float mag = m < 2u ? 0.5f * (float)m : (m < 4u ? 1.0f + 0.5f * (float)(m - 2u) : (float)(1u << (m / 2u - 1u)) * (1.0f + 0.5f * (float)(m & 1u)));
  return (v.__x & 8u) ? -mag : mag;
}

template <class T>
LR_DEV T from_f32(float v);
template <>
LR_DEV float from_f32<float>(float v) { return v; }
template <>
LR_DEV f16 from_f32<f16>(float v) { return __float2half_rn(v); }
template <>
LR_DEV bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
LR_DEV f8e4m3 from_f32<f8e4m3>(float v) {
  f8e4m3 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_NOSAT, __NV_E4M3);
  return r;
}
template <>
LR_DEV f8e5m2 from_f32<f8e5m2>(float v) {
  f8e5m2 r;
  r.__x = __nv_cvt_float_to_fp8(v, __NV_NOSAT, __NV_E5M2);
  return r;
}
template <>
LR_DEV int from_f32<int>(float v) { return (int)v; }  // truncation toward zero, as C and the reference
template <>
LR_DEV u8 from_f32<u8>(float v) { return (u8)(int)v; }
template <>
LR_DEV bool from_f32<bool>(float v) { return v != 0.0f; }
// nearest E2M1 value, ties to the even code, saturating at 6 (inf too); NaN gives -0, as ml_dtypes
template <>
LR_DEV f4e2m1 from_f32<f4e2m1>(float v) {
  f4e2m1 r;
  if (v != v) {
    r.__x = 8u;
    return r;
  }
  const float a = fabsf(v);
  const unsigned m = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u : a <= 2.5f ? 4u
                   : a < 3.5f ? 5u : a <= 5.0f ? 6u : 7u;
  r.__x = (unsigned char)(m | (signbit(v) ? 8u : 0u));
  return r;
}

// a float rounded to a narrower format and held in f32 again (the reference's Cast to a narrow float)
template <class T>
LR_DEV float round_to(float v) { return to_f32(from_f32<T>(v)); }

LR_DEV float f32_bits(unsigned u) { return __int_as_float((int)u); }

// ---- reductions ---------------------------------------------------------------------------------------------
struct SumOp {
  LR_DEV float operator()(float a, float b) const { return a + b; }
  LR_DEV int operator()(int a, int b) const { return (int)((unsigned)a + (unsigned)b); }  // wraps, as numpy
  LR_DEV unsigned operator()(unsigned a, unsigned b) const { return a + b; }
};
struct MaxOp {  // propagates NaN, as numpy's max
  LR_DEV float operator()(float a, float b) const { return (a > b || a != a) ? a : b; }
  LR_DEV int operator()(int a, int b) const { return a > b ? a : b; }
  LR_DEV unsigned operator()(unsigned a, unsigned b) const { return a > b ? a : b; }
};

template <class T, class Op>
LR_DEV T warp_reduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread of the block gets the reduction of `v` over the block (BLOCK threads, a multiple of 32).
// `smem` holds 32 floats; the trailing barrier lets the caller reuse it at once.
template <int BLOCK, class Op>
LR_DEV float block_reduce(float v, Op op, float identity, float* smem) {
  v = warp_reduce(v, op);
  if (BLOCK <= 32) return v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < BLOCK / 32 ? smem[lane] : identity;
  v = warp_reduce(v, op);
  __syncthreads();
  return v;
}

// 16-byte vector of N elements of T (one ld.global.v4 on the device)
template <class T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <class T>
LR_DEV bool lr_aligned(const T* p, int bytes) { return ((unsigned long long)p) % (unsigned long long)bytes == 0; }
