// Row kernels over the last axis of a [rows, n] view: Softmax, LayerNorm, RMSNorm, GroupNorm (LayerNorm on the
// grouped view, its affine transform and SiLU in the epilogue), RMSNormRoPE (RMSNorm, its weight and the rotation
// of adjacent pairs in the epilogue). One block of BLOCK threads per row (grid-stride
// over rows); with ITEMS > 0 each thread keeps its ITEMS values of the row in registers (n <= BLOCK * ITEMS),
// otherwise every pass re-reads the row (large n). Arithmetic follows the numpy runtime: f32 throughout, softmax
// = exp(x - max) / sum, LayerNorm two-pass ((x - mean) then its mean square), inv = 1 / sqrt(v + eps), out = x' *
// inv.
#pragma once

enum RowKind { ROW_SOFTMAX = 0, ROW_LAYERNORM = 1, ROW_RMSNORM = 2, ROW_RMSNORM_ROPE = 3 };

// The norms' affine part, applied to each normalised value before it is stored: none here; a generated functor
// (value * scale [+ shift], each read through its view) for an affine LayerNorm / RMSNorm.
// the GroupNorm kernel's activation, as ops.silu composes it: u * 1 / (e^-u + 1)
LR_DEV float silu_f32(float u) { return u / (1.0f + expf(-u)); }

struct NoEpilogue {
  LR_DEV float operator()(long long, int, float v) const { return v; }
};

template <int BLOCK, int ITEMS, int KIND, class TO, class Load, class Epi = NoEpilogue>
LR_DEV void rows_kernel(TO* __restrict__ out, long long rows, int n, float eps, float inv_n, Load load,
                        Epi epi = Epi()) {
  __shared__ float red[32];
  const int t = threadIdx.x;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    TO* o = out + row * n;
    float xs[ITEMS > 0 ? ITEMS : 1];
    if (ITEMS > 0) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c = t + i * BLOCK;
        xs[i] = c < n ? load(row, c) : 0.0f;
      }
    }
#define LR_X(i, c) (ITEMS > 0 ? xs[i] : load(row, c))
#define LR_FOR_ROW(body)                                          \
  if (ITEMS > 0) {                                                \
    _Pragma("unroll") for (int i = 0; i < (ITEMS > 0 ? ITEMS : 1); ++i) { \
      const int c = t + i * BLOCK;                                \
      if (c < n) { body; }                                        \
    }                                                             \
  } else {                                                        \
    for (int c = t, i = 0; c < n; c += BLOCK) { body; }           \
  }
    if (KIND == ROW_SOFTMAX) {
      float m = -f32_bits(0x7f800000u);
      LR_FOR_ROW(m = MaxOp()(m, LR_X(i, c)))
      m = block_reduce<BLOCK>(m, MaxOp(), -f32_bits(0x7f800000u), red);
      float s = 0.0f;
      LR_FOR_ROW(s += expf(LR_X(i, c) - m))
      s = block_reduce<BLOCK>(s, SumOp(), 0.0f, red);
      LR_FOR_ROW(o[c] = from_f32<TO>(expf(LR_X(i, c) - m) / s))
    } else if (KIND == ROW_LAYERNORM) {
      float s = 0.0f;
      LR_FOR_ROW(s += LR_X(i, c))
      const float mean = block_reduce<BLOCK>(s, SumOp(), 0.0f, red) * inv_n;
      float q = 0.0f;
      LR_FOR_ROW(const float d = LR_X(i, c) - mean; q += d * d)
      const float var = block_reduce<BLOCK>(q, SumOp(), 0.0f, red) * inv_n;
      const float inv = 1.0f / sqrtf(var + eps);
      LR_FOR_ROW(o[c] = from_f32<TO>(epi(row, c, (LR_X(i, c) - mean) * inv)))
    } else {
      float q = 0.0f;
      LR_FOR_ROW(const float x = LR_X(i, c); q += x * x)
      const float ms = block_reduce<BLOCK>(q, SumOp(), 0.0f, red) * inv_n;
      const float inv = 1.0f / sqrtf(ms + eps);
      if constexpr (KIND == ROW_RMSNORM_ROPE) {
        // RMSNorm then the rotary embedding of adjacent pairs: each value with its partner's (c ^ 1, re-read
        // through the loader: it is another thread's), the epilogue weighting and rotating the two
        LR_FOR_ROW(o[c] = from_f32<TO>(epi.pair(row, c, LR_X(i, c) * inv, load(row, c ^ 1) * inv)))
      } else {
        LR_FOR_ROW(o[c] = from_f32<TO>(epi(row, c, LR_X(i, c) * inv)))
      }
    }
#undef LR_X
#undef LR_FOR_ROW
  }
}
