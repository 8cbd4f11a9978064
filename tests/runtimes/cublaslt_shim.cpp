// A stand-in libcublasLt for CPU tests of runtimes/cuda/cublaslt.py's ctypes binding: the entry points the binding
// calls, with cublasLt.h's signatures, on host memory. It records what the descriptors say (transposes, scale
// pointers, layouts, workspace preference), refuses anything a real cuBLASLt FP8 GEMM refuses that the binding
// could get wrong (a call before the heuristic, C != D, a wrong attribute size), and computes
// D = alpha * scale_a * scale_b * op(A) op(B) for e4m3 A/B and bf16/f32 D, summing in f32 in k order.
#include <cmath>
#include <cstdint>
#include <cstring>

extern "C" {
typedef int Status;  // cublasStatus_t: 0 success, 7 invalid value, 15 not supported
struct Handle { int created; };
struct Desc { int compute, scale, transa = 0, transb = 0; const float *sa = nullptr, *sb = nullptr; };
struct Layout { int type; uint64_t rows, cols; int64_t ld; };
struct Pref { uint64_t workspace = 0; };
struct Algo { uint64_t data[8]; };
struct Result { Algo algo; size_t workspaceSize; int state; float wavesCount; int reserved[4]; };

// what the last cublasLtMatmul saw, for the test to read
struct Seen { int transa, transb, a_type, b_type, d_type, had_sa, had_sb; uint64_t a_rows, a_cols, b_rows, b_cols,
              d_rows, d_cols; int64_t lda, ldb, ldd; uint64_t workspace_pref, workspace_given; int compute, scale; };
Seen lt_shim_seen;
int lt_shim_calls = 0;
uint64_t lt_shim_pref = 0;

Status cublasLtCreate(Handle** h) { *h = new Handle{1}; return 0; }
size_t cublasLtGetVersion() { return 130000; }
const char* cublasLtGetStatusName(Status s) { return s == 7 ? "CUBLAS_STATUS_INVALID_VALUE" : "CUBLAS_STATUS_NOT_SUPPORTED"; }
Status cublasLtMatmulDescCreate(Desc** d, int compute, int scale) { *d = new Desc{compute, scale}; return 0; }
Status cublasLtMatmulDescDestroy(Desc* d) { delete d; return 0; }
Status cublasLtMatmulDescSetAttribute(Desc* d, int attr, const void* buf, size_t size) {
  switch (attr) {
    case 3: if (size != 4) return 7; std::memcpy(&d->transa, buf, 4); return 0;
    case 4: if (size != 4) return 7; std::memcpy(&d->transb, buf, 4); return 0;
    case 17: if (size != 8) return 7; std::memcpy(&d->sa, buf, 8); return 0;
    case 18: if (size != 8) return 7; std::memcpy(&d->sb, buf, 8); return 0;
    default: return 7;
  }
}
Status cublasLtMatrixLayoutCreate(Layout** l, int type, uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < (int64_t)rows) return 7;
  *l = new Layout{type, rows, cols, ld};
  return 0;
}
Status cublasLtMatrixLayoutDestroy(Layout* l) { delete l; return 0; }
Status cublasLtMatmulPreferenceCreate(Pref** p) { *p = new Pref; return 0; }
Status cublasLtMatmulPreferenceDestroy(Pref* p) { delete p; return 0; }
Status cublasLtMatmulPreferenceSetAttribute(Pref* p, int attr, const void* buf, size_t size) {
  if (attr != 1 || size != 8) return 7;
  std::memcpy(&p->workspace, buf, 8);
  return 0;
}
Status cublasLtMatmulAlgoGetHeuristic(Handle*, Desc* d, Layout* a, Layout* b, Layout* c, Layout* dd, Pref* p,
                                      int requested, Result* out, int* count) {
  *count = 0;
  if (requested < 1) return 7;
  // FP8 on Hopper: TN only, f32 compute (68) and scale (0), e4m3 (28) / e5m2 (29) operands, C like D
  if (d->transa != 1 || d->transb != 0 || d->compute != 68 || d->scale != 0) return 0;
  if ((a->type != 28 && a->type != 29) || (b->type != 28 && b->type != 29) || c->type != dd->type) return 0;
  lt_shim_pref = p->workspace;
  std::memset(out, 0, sizeof(Result));
  out->algo.data[0] = 0x5eed;
  out->workspaceSize = p->workspace < (1u << 20) ? p->workspace : (1u << 20);
  *count = 1;
  return 0;
}

static float e4m3(uint8_t v) {
  const int s = v >> 7, e = (v >> 3) & 15, m = v & 7;
  if (e == 15 && m == 7) return NAN;
  const float mag = e == 0 ? std::ldexp((float)m, -9) : std::ldexp((float)(8 + m), e - 10);
  return s ? -mag : mag;
}
static uint16_t f32_to_bf16(float f) {
  uint32_t u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

Status cublasLtMatmul(Handle*, Desc* d, const void* alpha, const void* A, Layout* la, const void* B, Layout* lb,
                      const void* beta, const void* C, Layout* lc, void* D, Layout* ld, const Algo* algo,
                      void* workspace, size_t workspace_bytes, void* stream) {
  if (algo == nullptr || algo->data[0] != 0x5eed) return 7;  // the heuristic's algorithm, passed back
  if (C != D || lc->type != ld->type || lc->ld != ld->ld) return 7;
  if (la->type != 28 || lb->type != 28 || (ld->type != 14 && ld->type != 0)) return 15;
  const float a = *(const float*)alpha, bt = *(const float*)beta;
  if (bt != 0.0f) return 15;
  const int64_t m = ld->rows, n = ld->cols, k = d->transa ? la->rows : la->cols;
  lt_shim_seen = Seen{d->transa, d->transb, la->type, lb->type, ld->type, d->sa != nullptr, d->sb != nullptr,
                      la->rows, la->cols, lb->rows, lb->cols, ld->rows, ld->cols, la->ld, lb->ld, ld->ld, lt_shim_pref,
                      workspace_bytes, d->compute, d->scale};
  const float scale = a * (d->sa ? *d->sa : 1.0f) * (d->sb ? *d->sb : 1.0f);
  const uint8_t* pa = (const uint8_t*)A;
  const uint8_t* pb = (const uint8_t*)B;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      float acc = 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        const float av = e4m3(d->transa ? pa[i * la->ld + p] : pa[p * la->ld + i]);
        const float bv = e4m3(d->transb ? pb[p * lb->ld + j] : pb[j * lb->ld + p]);
        acc += av * bv;
      }
      const float v = acc * scale;
      if (ld->type == 14) ((uint16_t*)D)[j * ld->ld + i] = f32_to_bf16(v);
      else ((float*)D)[j * ld->ld + i] = v;
    }
  ++lt_shim_calls;
  (void)workspace;
  (void)stream;
  return 0;
}
}
