// GGUF block types (graph.gguf_blocks): element e of the block at `b`, decoded as gguf-py decodes it (the products in
// its order; NVRTC runs with --fmad=false and cuda-emu with -ffp-contract=off, so the bits are the same).
// kind: 0 Q4_0, 1 Q4_1, 2 Q5_0, 3 Q5_1, 4 Q8_0, 5 Q2_K, 6 Q3_K, 7 Q4_K, 8 Q5_K, 9 Q6_K, 10 F16, 11 BF16, 12 F32,
// 13 IQ4_NL, 14 IQ4_XS
// (float kinds: `b` is the element itself, e = 0).

LR_DEV float lr_gguf_h(const unsigned char* p) {
  const unsigned int h = (unsigned int)p[0] | ((unsigned int)p[1] << 8);
  const unsigned int s = (h & 0x8000u) << 16, ex = (h >> 10) & 31u, m = h & 1023u;
  if (ex == 0) {
    const float v = (float)m * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return s ? -v : v;
  }
  if (ex == 31) return __int_as_float((int)(s | 0x7f800000u | (m << 13)));
  return __int_as_float((int)(s | ((ex + 112u) << 23) | (m << 13)));
}

LR_DEV void lr_gguf_k_scale_min(const unsigned char* s, int j, int* sc, int* mn) {
  if (j < 4) {
    *sc = s[j] & 63;
    *mn = s[j + 4] & 63;
  } else {
    *sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// IQ4_NL / IQ4_XS: the value of a 4-bit code (ggml-common.h's kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22,
// -10, 1, 13, 25, 38, 53, 69, 89, 113}), its 16 bytes packed in two 64-bit constants (a local array would be a
// stack frame: tests/runtimes/test_cuda_nvrtc.py)
LR_DEV float lr_gguf_iq4(int code) {
  const unsigned long long w = (code & 8) ? 0x7159453526190d01ULL : 0xf6eaddcfbfad9881ULL;
  return (float)(signed char)(unsigned char)(w >> (8 * (code & 7)));
}

LR_DEV float lr_gguf_value(int kind, const unsigned char* b, int e) {
  switch (kind) {
    case 0: case 1: {
      const int p = kind == 0 ? 2 : 4;
      const int nib = e < 16 ? (b[p + e] & 15) : (b[p + e - 16] >> 4);
      if (kind == 0) return lr_gguf_h(b) * (float)(nib - 8);
      return (lr_gguf_h(b) * (float)nib) + lr_gguf_h(b + 2);
    }
    case 2: case 3: {
      const int h = kind == 2 ? 2 : 4;
      const int nib = e < 16 ? (b[h + 4 + e] & 15) : (b[h + 4 + e - 16] >> 4);
      const int q = nib | (((b[h + e / 8] >> (e % 8)) & 1) << 4);
      if (kind == 2) return lr_gguf_h(b) * (float)(q - 16);
      return (lr_gguf_h(b) * (float)q) + lr_gguf_h(b + 2);
    }
    case 4:
      return (float)(signed char)b[2 + e] * lr_gguf_h(b);
    case 5: {
      const int sc = b[e / 16];
      const float dl = lr_gguf_h(b + 80) * (float)(sc & 15);
      const float ml = lr_gguf_h(b + 82) * (float)(sc >> 4);
      const int q = (b[16 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      return dl * (float)q - ml;
    }
    case 6: {
      const int s = e / 16;
      const int lo4 = s < 8 ? (b[96 + s] & 15) : (b[96 + s - 8] >> 4);
      const int hi2 = (b[104 + s % 4] >> (2 * (s / 4))) & 3;
      const float dl = lr_gguf_h(b + 108) * (float)((lo4 | (hi2 << 4)) - 32);
      const int ql = (b[32 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      const int hb = (b[e % 32] >> (e / 32)) & 1;
      return dl * (float)(ql - (hb ? 0 : 4));
    }
    case 7: case 8: {
      int sc, mn;
      lr_gguf_k_scale_min(b + 4, e / 32, &sc, &mn);
      const float dl = lr_gguf_h(b) * (float)sc;
      const float ml = lr_gguf_h(b + 2) * (float)mn;
      const int p = kind == 7 ? 16 : 48;
      int q = (b[p + (e / 64) * 32 + e % 32] >> (4 * ((e % 64) / 32))) & 15;
      if (kind == 8) q |= ((b[16 + e % 32] >> (e / 32)) & 1) << 4;
      return dl * (float)q - ml;
    }
    case 9: {
      const float dl = lr_gguf_h(b + 208) * (float)(signed char)b[192 + e / 16];
      const int low = (b[(e / 128) * 64 + e % 64] >> (4 * ((e % 128) / 64))) & 15;
      const int hi = (b[128 + (e / 128) * 32 + e % 32] >> (2 * ((e % 128) / 32))) & 3;
      return dl * (float)((low | (hi << 4)) - 32);
    }
    case 13:  // IQ4_NL: d, 16 bytes of table indices (low nibbles first)
      return lr_gguf_h(b) * lr_gguf_iq4(e < 16 ? b[2 + e] : (b[2 + e - 16] >> 4));
    case 14: {  // IQ4_XS: d, scales_h (u16), scales_l[4], 8 sub-blocks of 16 bytes of table indices
      const int s = e / 32, l = e % 32;
      const int lo = (b[4 + s / 2] >> (4 * (s % 2))) & 15;
      const int hi = (((int)b[2] | ((int)b[3] << 8)) >> (2 * s)) & 3;
      const float dl = lr_gguf_h(b) * (float)((lo | (hi << 4)) - 32);
      return dl * lr_gguf_iq4(l < 16 ? b[8 + s * 16 + l] : (b[8 + s * 16 + l - 16] >> 4));
    }
    case 10:
      return lr_gguf_h(b);
    case 11:
      return __int_as_float((int)(((unsigned int)b[0] | ((unsigned int)b[1] << 8)) << 16));
    default:
      return __int_as_float((int)((unsigned int)b[0] | ((unsigned int)b[1] << 8) | ((unsigned int)b[2] << 16) |
                                  ((unsigned int)b[3] << 24)));
  }
}
