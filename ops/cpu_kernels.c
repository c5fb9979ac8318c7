// Matmuls that read GGUF block-quantized weights as they are, for the CPU decode path.
//
// y[m, n] = sum_k x[m, k] * w[n, k] for a few rows m (a decode step is bound by reading the weights:
// 5-8.5 bits per weight instead of 32). Each weight is rebuilt exactly as the reference dequantizes
// it (d * q + m, d * q in float32; both products are exact), so results differ from a float32
// GEMM on the dequantized weights only by the order of the float32 sums.
//
// Layouts (repacked from GGUF at load by ops/quant.py): per row n, K / 32 blocks of 32 weights.
//   q4: 16 bytes a block, weight j in the low nibble of byte j, weight j + 16 in its high nibble;
//       d[n, b], m[n, b] float32: w = d * q + m (Q4_0 comes as m = -8 d).
//   q8: 32 signed bytes a block; d[n, b] float32: w = d * q.
// Built with -O3 -march=native -fopenmp by ops/cpu_kernels.py; the threads are torch's OpenMP pool.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define MR 4  // activation rows per pass over the weights

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

static inline void q4_rows(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y,
                           int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m512 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *q = qs + (size_t)n * nb * 16;
    for (int b = 0; b < nb; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(q + b * 16));
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low)));
        __m512 dv = _mm512_set1_ps(d[(size_t)n * nb + b]), mv = _mm512_set1_ps(mn[(size_t)n * nb + b]);
        __m512 w0 = _mm512_fmadd_ps(lo, dv, mv), w1 = _mm512_fmadd_ps(hi, dv, mv);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

static inline void q8_rows(const int8_t *qs, const float *d, const float *x, float *y, int rows, int n, int K,
                           int ldy) {
    const int nb = K / 32;
    __m512 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *q = qs + (size_t)n * K;
    for (int b = 0; b < nb; b++) {
        __m512 dv = _mm512_set1_ps(d[(size_t)n * nb + b]);
        __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32)))), dv);
        __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + b * 32 + 16)))), dv);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

// x [M, K] and y [M, N] row-major float32, K a multiple of 32.
void xinfer_q4_mm(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y, int M, int N, int K) {
    for (int m0 = 0; m0 < M; m0 += MR) {
        int rows = M - m0 < MR ? M - m0 : MR;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) q4_rows(qs, d, mn, x + (size_t)m0 * K, y + (size_t)m0 * N, rows, n, K, N);
    }
}

void xinfer_q8_mm(const int8_t *qs, const float *d, const float *x, float *y, int M, int N, int K) {
    for (int m0 = 0; m0 < M; m0 += MR) {
        int rows = M - m0 < MR ? M - m0 : MR;
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) q8_rows(qs, d, x + (size_t)m0 * K, y + (size_t)m0 * N, rows, n, K, N);
    }
}

// Decode attention straight from the paged KV cache (no gather): one query row per sequence.
// q [B, Hq, D] contiguous, caches [blocks, bs, Hkv, D], tables [B, table_stride]
// int32, lens [B] int32 (KV length, the new token included), out [B, Hq, D]. The Hq / Hkv query
// heads of a group share each K/V read. window > 0: only the last `window` positions; softcap > 0:
// scores = softcap * tanh(scores / softcap).
void xinfer_paged_decode(const float *q, const float *kc, const float *vc, const int32_t *tables, int table_stride,
                         const int32_t *lens, float *out, int B, int Hq, int Hkv, int D, int bs, float scale,
                         int window, float softcap) {
    const int G = Hq / Hkv;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < Hkv; h++) {
            const int L = lens[b];
            const int start = (window > 0 && L > window) ? L - window : 0;
            const int n = L - start;
            float *s = malloc(sizeof(float) * (size_t)G * (n > 0 ? n : 1));
            const float *qh = q + (size_t)b * Hq * D + (size_t)h * G * D;
            const int32_t *tab = tables + (size_t)b * table_stride;
            float mx[G];
            for (int g = 0; g < G; g++) mx[g] = -INFINITY;
            for (int t = start; t < L; t++) {
                const float *k = kc + (((size_t)tab[t / bs] * bs + t % bs) * Hkv + h) * D;
                for (int g = 0; g < G; g++) {
                    const float *qg = qh + (size_t)g * D;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int i = 0; i < D; i++) acc += qg[i] * k[i];
                    acc *= scale;
                    if (softcap > 0.f) acc = softcap * tanhf(acc / softcap);
                    s[(size_t)g * n + (t - start)] = acc;
                    if (acc > mx[g]) mx[g] = acc;
                }
            }
            float *o = out + (size_t)b * Hq * D + (size_t)h * G * D;
            for (int g = 0; g < G; g++) {
                float *sg = s + (size_t)g * n, sum = 0.f;
                for (int j = 0; j < n; j++) {
                    sg[j] = expf(sg[j] - mx[g]);
                    sum += sg[j];
                }
                float inv = sum > 0.f ? 1.f / sum : 0.f;
                for (int j = 0; j < n; j++) sg[j] *= inv;
                for (int i = 0; i < D; i++) o[(size_t)g * D + i] = 0.f;
            }
            for (int t = start; t < L; t++) {
                const float *v = vc + (((size_t)tab[t / bs] * bs + t % bs) * Hkv + h) * D;
                for (int g = 0; g < G; g++) {
                    const float p = s[(size_t)g * n + (t - start)];
                    float *og = o + (size_t)g * D;
#pragma omp simd
                    for (int i = 0; i < D; i++) og[i] += p * v[i];
                }
            }
            free(s);
        }
    }
}

// residual += x (when residual is given), then out = w * (r / sqrt(mean(r^2) + eps)) per row of H,
// with w + offset for Gemma's (1 + w) scaling: RMSNorm in float32, with the residual add fused.
void xinfer_add_rmsnorm(const float *x, float *residual, const float *w, float *out, int T, int H, float eps,
                        float offset) {
#pragma omp parallel for schedule(static) if (T > 4)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * H;
        float *rr = residual ? residual + (size_t)t * H : NULL;
        float *o = out + (size_t)t * H;
        float ss = 0.f;
        for (int i = 0; i < H; i++) {
            float r = rr ? rr[i] + xr[i] : xr[i];
            if (rr) rr[i] = r;
            ss += r * r;
        }
        const float inv = 1.f / sqrtf(ss / H + eps);
        const float *src = rr ? rr : xr;
        for (int i = 0; i < H; i++) o[i] = (w[i] + offset) * (src[i] * inv);
    }
}

// Rotary embedding in place, HF's rotate-half layout over the first rot_dim of each head:
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin. q [T, Hq, D] and k [T, Hk, D] with row strides
// q_stride / k_stride (views into the QKV projection's output); cos/sin [positions, rot_dim / 2].
static void rope_rows(float *x, int64_t stride, int H, int D, int rot, const float *cos, const float *sin,
                      const int64_t *pos, int T) {
    const int half = rot / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)pos[t] * half, *s = sin + (size_t)pos[t] * half;
        for (int h = 0; h < H; h++) {
            float *v = x + (size_t)t * stride + (size_t)h * D;
            for (int i = 0; i < half; i++) {
                const float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
}

void xinfer_rope(float *q, float *k, const float *cos, const float *sin, const int64_t *pos, int T, int Hq, int Hk,
                 int D, int rot, int64_t q_stride, int64_t k_stride) {
    rope_rows(q, q_stride, Hq, D, rot, cos, sin, pos, T);
    rope_rows(k, k_stride, Hk, D, rot, cos, sin, pos, T);
}
