// Flash attention, portable SIMT version (no tensor cores: it runs on every GPU and under cuda-emu).
// One block = WARPS warps x ROWS query rows each; keys and values are staged in shared memory in tiles of 32,
// one key per lane: lane j computes the scores of key j for its warp's rows, the tile's max and sum are warp
// reductions, and the p_j are broadcast by shuffles into the (rows x DV/32 per lane) accumulators. Online softmax
// as the numpy runtime's AttentionBlocked: running max starting at the most negative finite f32 (a fully masked
// tile never gives -inf - -inf), q scaled once, out = acc / sum. S x T is never materialised.
#pragma once

struct NoBias {
  LR_DEV float operator()(long long, long long, long long) const { return 0.0f; }
};

template <int D, int DV, int WARPS, int ROWS, bool HAS_BIAS, class TO, class LQ, class LK, class LV, class LB>
LR_DEV void flash_attention(TO* __restrict__ out, long long heads, int s_len, int t_len, float scale, LQ lq, LK lk,
                            LV lv, LB lb) {
  constexpr int BK = 32, QROWS = WARPS * ROWS, NV = (DV + 31) / 32;
  __shared__ float ks[BK][D + 1];  // +1: lanes read different rows without bank conflicts
  __shared__ float vs[BK][DV];
  __shared__ float qs[QROWS][D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int qblocks = (s_len + QROWS - 1) / QROWS;
  const float lowest = -3.40282347e+38f;
  for (long long work = blockIdx.x; work < heads * qblocks; work += gridDim.x) {
    const long long h = work / qblocks;
    const int q0 = (int)(work % qblocks) * QROWS;
    __syncthreads();  // the previous work item is done with qs
    for (int e = threadIdx.x; e < QROWS * D; e += blockDim.x) {
      const int r = e / D, d = e % D;
      qs[r][d] = q0 + r < s_len ? lq(h, q0 + r, d) * scale : 0.0f;
    }
    float m[ROWS], l[ROWS], acc[ROWS][NV];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      m[r] = lowest;
      l[r] = 0.0f;
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[r][i] = 0.0f;
    }
    for (int t0 = 0; t0 < t_len; t0 += BK) {
      __syncthreads();  // qs staged; the previous tile consumed
      for (int e = threadIdx.x; e < BK * D; e += blockDim.x) {
        const int j = e / D, d = e % D;
        ks[j][d] = t0 + j < t_len ? lk(h, t0 + j, d) : 0.0f;
      }
      for (int e = threadIdx.x; e < BK * DV; e += blockDim.x) {
        const int j = e / DV, d = e % DV;
        vs[j][d] = t0 + j < t_len ? lv(h, t0 + j, d) : 0.0f;
      }
      __syncthreads();
      const bool key = t0 + lane < t_len;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int qi = warp * ROWS + r;
        float sc = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) sc = fmaf(qs[qi][d], ks[lane][d], sc);
        if (HAS_BIAS && key && q0 + qi < s_len) sc += lb(h, q0 + qi, t0 + lane);
        const float tile_max = warp_reduce(key ? sc : lowest, MaxOp());
        const float m_new = MaxOp()(m[r], tile_max);
        const float p = key ? expf(sc - m_new) : 0.0f;
        const float rescale = expf(m[r] - m_new);
        l[r] = l[r] * rescale + warp_reduce(p, SumOp());
#pragma unroll
        for (int i = 0; i < NV; ++i) acc[r][i] *= rescale;
        for (int j = 0; j < BK; ++j) {
          const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
          for (int i = 0; i < NV; ++i) {
            const int d = lane + 32 * i;
            if (d < DV) acc[r][i] = fmaf(pj, vs[j][d], acc[r][i]);
          }
        }
        m[r] = m_new;
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int qi = q0 + warp * ROWS + r;
      if (qi >= s_len) continue;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int d = lane + 32 * i;
        if (d < DV) out[(h * s_len + qi) * DV + d] = from_f32<TO>(l[r] > 0.0f ? acc[r][i] / l[r] : 0.0f);
      }
    }
  }
}
