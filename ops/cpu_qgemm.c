// y [M, N] = x [M, K] w^T for GGUF Q4_K, Q6_K and Q8_0 weights held once, in their own bits, for every
// batch size: decode, batched decode and prefill alike (ops/qgemm.py). The activations are quantized to
// 8 bits with one scale per 32 values (Q8_0's format; llama.cpp uses it for Q8_0 weights and a coarser
// one, Q8_K's per 256, for the K-quants: per 32 measured several times closer to the float path on
// Gemma-3-270M, bench/NOTES-cpu.md), and the integer dot products run on the VNNI units (vpdpbusd: 64
// multiply-adds an instruction, twice the bfloat16 dot products' rate). Sums are exact in int32 up to
// each 32 inputs' float scale.
//
// Layout (xinfer_qg_pack, from the GGUF blocks): 16 output columns a panel; per panel, per super-block
// (256 inputs; 32 for Q8_0), the weights of a k-group (4 consecutive inputs) of the 16 columns in one
// 64-byte vector, column c at bytes 4c..4c+3, as vpdpbusd reads them against 4 broadcast activations.
//   Q4_K (kind 0), 2,432 bytes: 8 sub-blocks x 4 vectors of nibbles (vector v of sub-block j: k-group
//        v in the low nibbles, v + 4 in the high ones); sc[8][16] and mn[8][16] as bytes (the 6-bit
//        scales and mins); d[16], dmin[16] float32.
//   Q6_K (kind 1), 3,392 bytes: the low 4 bits of q (0..63) as Q4_K's nibbles; per 32 inputs j, two
//        vectors of the high 2 bits (the first for k-groups 8j .. 8j + 3, bits 2v of a byte for group
//        8j + v; the second for 8j + 4 ..); sc[16][16] int8; d[16] float32.
//   Q8_0 (kind 2), 576 bytes: 8 vectors of q + 128 as bytes; d[16] float32.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QG 1
#else
#define QG 0
#endif

int xinfer_qg_available(void) { return QG; }

static const int SB[3] = {256, 256, 32};        // inputs a super-block
static const int SB_BYTES[3] = {2432, 3392, 576}; // bytes a (panel, super-block)

long xinfer_qg_bytes(int kind, int N, int K) { return (long)(N / 16) * (K / SB[kind]) * SB_BYTES[kind]; }


// Q4_K / Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins (ggml's get_scale_min_k4)
static void k4_scales(const uint8_t *q, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 8; j++) {
        if (j < 4) { sc[j] = q[j] & 63; mn[j] = q[j + 4] & 63; }
        else { sc[j] = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
    }
}

// One column's super-block as plain integers: Q4_K q[256], sc[8], mn[8], d, dmin; Q6_K q[256] (0..63),
// sc[16], d; Q8_0 q[32] + 128 (0..255), d. The bit layouts are ggml's (ggml-quants.c dequantize_row_*).
static void unpack_col(int kind, const uint8_t *b, uint8_t *q, int *sc, int *mn, float *d, float *dmin) {
    if (kind == 0) {
        *d = _cvtsh_ss(b[0] | b[1] << 8);
        *dmin = _cvtsh_ss(b[2] | b[3] << 8);
        uint8_t s8[8], m8[8];
        k4_scales(b + 4, s8, m8);
        for (int j = 0; j < 8; j++) { sc[j] = s8[j]; mn[j] = m8[j]; }
        const uint8_t *qs = b + 16;
        for (int c = 0; c < 4; c++)  // 64 inputs a chunk: 32 bytes, low nibbles first
            for (int l = 0; l < 32; l++) { q[64 * c + l] = qs[32 * c + l] & 15; q[64 * c + 32 + l] = qs[32 * c + l] >> 4; }
    } else if (kind == 1) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *s = (const int8_t *)(b + 192);
        *d = _cvtsh_ss(b[208] | b[209] << 8);
        for (int j = 0; j < 16; j++) sc[j] = s[j];
        for (int h = 0; h < 2; h++)  // two halves of 128
            for (int l = 0; l < 32; l++) {
                const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
                uint8_t *o = q + 128 * h;
                o[l] = (L[l] & 15) | (((H[l] >> 0) & 3) << 4);
                o[l + 32] = (L[l + 32] & 15) | (((H[l] >> 2) & 3) << 4);
                o[l + 64] = (L[l] >> 4) | (((H[l] >> 4) & 3) << 4);
                o[l + 96] = (L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4);
            }
    } else {
        *d = _cvtsh_ss(b[0] | b[1] << 8);
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(b[2 + l] ^ 0x80);  // q + 128
    }
}

// The GGUF blocks of weights [N, K] (row n: K / 256 (Q8_0: K / 32) blocks, ggml's bytes) -> out, in the
// layout above (xinfer_qg_bytes of it). N a multiple of 16, K of the super-block.
void xinfer_qg_pack(int kind, const uint8_t *src, int N, int K, uint8_t *out) {
    const int sb = SB[kind], nsb = K / sb, bb = kind == 0 ? 144 : kind == 1 ? 210 : 34;
    #pragma omp parallel for schedule(static)
    for (int p = 0; p < N / 16; p++) {
        uint8_t q[16][256];  // Q8_0's as q + 128
        int sc[16][16], mn[16][8];
        float d[16], dm[16];
        for (int s = 0; s < nsb; s++) {
            for (int c = 0; c < 16; c++)
                unpack_col(kind, src + ((size_t)(16 * p + c) * nsb + s) * bb, q[c], sc[c], mn[c], &d[c], &dm[c]);
            uint8_t *o = out + ((size_t)p * nsb + s) * SB_BYTES[kind];
            if (kind == 0) {
                for (int j = 0; j < 8; j++)
                    for (int v = 0; v < 4; v++)
                        for (int c = 0; c < 16; c++)
                            for (int t = 0; t < 4; t++)
                                o[(j * 4 + v) * 64 + 4 * c + t] = q[c][32 * j + 4 * v + t] | q[c][32 * j + 16 + 4 * v + t] << 4;
                o += 2048;
                for (int j = 0; j < 8; j++) for (int c = 0; c < 16; c++) o[16 * j + c] = sc[c][j];
                o += 128;
                for (int j = 0; j < 8; j++) for (int c = 0; c < 16; c++) o[16 * j + c] = mn[c][j];
                o += 128;
                memcpy(o, d, 64);
                memcpy(o + 64, dm, 64);
            } else if (kind == 1) {
                memset(o + 2048, 0, 1024);
                for (int j = 0; j < 8; j++)
                    for (int v = 0; v < 4; v++)
                        for (int c = 0; c < 16; c++)
                            for (int t = 0; t < 4; t++) {
                                const int a = q[c][32 * j + 4 * v + t], b = q[c][32 * j + 16 + 4 * v + t];
                                o[(j * 4 + v) * 64 + 4 * c + t] = (a & 15) | (b & 15) << 4;
                                o[2048 + j * 128 + 4 * c + t] |= (a >> 4) << (2 * v);
                                o[2048 + j * 128 + 64 + 4 * c + t] |= (b >> 4) << (2 * v);
                            }
                o += 3072;
                for (int j = 0; j < 16; j++) for (int c = 0; c < 16; c++) o[16 * j + c] = (uint8_t)(int8_t)sc[c][j];
                memcpy(o + 256, d, 64);
            } else {
                for (int g = 0; g < 8; g++)
                    for (int c = 0; c < 16; c++)
                        for (int t = 0; t < 4; t++) o[g * 64 + 4 * c + t] = q[c][4 * g + t];
                memcpy(o + 512, d, 64);
            }
        }
    }
}

// Rows ids[0 .. n - 1] of packed weights [N, K] as float32 (out [n, K]), exactly as ggml
// dequantizes them: an embedding table held once, in the head's blocks.
void xinfer_qg_rows(int kind, const uint8_t *pw, int K, const int64_t *ids, int n, float *out) {
    const int sb = SB[kind], nsb = K / sb;
    #pragma omp parallel for schedule(static) if (n > 8)
    for (int i = 0; i < n; i++) {
        const int p = (int)(ids[i] / 16), c = (int)(ids[i] % 16);
        float *o = out + (size_t)i * K;
        for (int s = 0; s < nsb; s++, o += sb) {
            const uint8_t *w = pw + ((size_t)p * nsb + s) * SB_BYTES[kind];
            if (kind == 0) {
                float d, dm;
                memcpy(&d, w + 2304 + 4 * c, 4);
                memcpy(&dm, w + 2368 + 4 * c, 4);
                for (int j = 0; j < 8; j++) {
                    const float sc = d * w[2048 + 16 * j + c], mn = dm * w[2176 + 16 * j + c];
                    for (int v = 0; v < 4; v++)
                        for (int t = 0; t < 4; t++) {
                            const uint8_t b = w[(j * 4 + v) * 64 + 4 * c + t];
                            o[32 * j + 4 * v + t] = sc * (b & 15) - mn;
                            o[32 * j + 16 + 4 * v + t] = sc * (b >> 4) - mn;
                        }
                }
            } else if (kind == 1) {
                float d;
                memcpy(&d, w + 3328 + 4 * c, 4);
                for (int i = 0; i < 256; i++) {
                    const int j = i / 32, hi = (i % 32) >= 16, v = (i % 16) / 4, t = i % 4;
                    const uint8_t b = w[(j * 4 + v) * 64 + 4 * c + t];
                    const int q = (hi ? b >> 4 : b & 15) | ((w[2048 + j * 128 + 64 * hi + 4 * c + t] >> (2 * v)) & 3) << 4;
                    o[i] = d * (int8_t)w[3072 + 16 * (i / 16) + c] * (q - 32);
                }
            } else {
                float d;
                memcpy(&d, w + 512 + 4 * c, 4);
                for (int g = 0; g < 8; g++)
                    for (int t = 0; t < 4; t++) o[4 * g + t] = d * (w[g * 64 + 4 * c + t] - 128);
            }
        }
    }
}

// A row of quantized activations takes QLD(K) bytes: 4 KiB apart, a tile's rows would share their L1 sets.
#define QLD(K) ((K) + 64)

// Quantized activations: q [M, QLD(K)] int8 with a scale d per 32 inputs (max |x| / 127, round to nearest), d
// [M, K / 32]; the integer sums s16 [M, K / 16] and s32 [M, K / 32] (int16), and xs [M, K / 32] = d * s32
// (float), that the weights' offsets read.
void xinfer_qg_quant(const float *x, int M, int K, int8_t *q, float *d, int16_t *s16, int16_t *s32, float *xs) {
    const int nb = K / 32;
    #pragma omp parallel for schedule(static) if ((long)M * K > 65536)
    for (int r = 0; r < M; r++)
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * 32;
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xb[i]));
            const float dd = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
            int8_t *qo = q + (size_t)r * QLD(K) + (size_t)b * 32;
            int lo = 0, hi = 0;
            for (int i = 0; i < 32; i++) {
                qo[i] = (int8_t)lrintf(xb[i] * id);
                if (i < 16) lo += qo[i]; else hi += qo[i];
            }
            const size_t i = (size_t)r * nb + b;
            d[i] = dd;
            s16[2 * i] = (int16_t)lo, s16[2 * i + 1] = (int16_t)hi, s32[i] = (int16_t)(lo + hi);
            xs[i] = dd * (float)(lo + hi);
        }
}

#if QG
#define QPF 8192  // bytes ahead the tiles prefetch their weights
#define RT 6  // rows a tile: 3 accumulators a row, 18 of the 32 vector registers

static inline __m512i bcast(const int8_t *p) { int v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

// One tile: R rows (x r * QLD(K) apart, scales xd r * nsb apart, sums likewise) against panel w of nsb
// super-blocks, into y (ldy apart).
static inline __attribute__((always_inline)) void tile_q4k(const uint8_t *w, int nsb, const int8_t *x, const float *xd,
                                                            const void *sums, int K, float *y, int ldy, int R) {
    const float *xs = sums;  // d * the sum of each 32 inputs (the mins' term)
    const int nb = K / 32;
    __m512 accf[RT];
    for (int r = 0; r < R; r++) accf[r] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(15);
    for (int s = 0; s < nsb; s++, w += 2432) {
        const __m512 d = _mm512_loadu_ps((const float *)(w + 2304)), dm = _mm512_loadu_ps((const float *)(w + 2368));
        for (int j = 0; j < 8; j++) {
            // two chains a row (low and high nibbles): one row's step is bound by vpdpbusd's latency
            __m512i is[RT], ih[RT];
            for (int r = 0; r < R; r++) is[r] = ih[r] = _mm512_setzero_si512();
            for (int v = 0; v < 4; v++) {
                // the weights stream from memory once a call: fetched a super-block or two ahead
                _mm_prefetch((const char *)w + QPF + (j * 4 + v) * 76, _MM_HINT_T0);
                __m512i W = _mm512_loadu_si512(w + (j * 4 + v) * 64);
                __m512i lo = _mm512_and_si512(W, lo4), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), lo4);
                const int8_t *xk = x + s * 256 + 32 * j + 4 * v;
                for (int r = 0; r < R; r++) {
                    is[r] = _mm512_dpbusd_epi32(is[r], lo, bcast(xk + (size_t)r * QLD(K)));
                    ih[r] = _mm512_dpbusd_epi32(ih[r], hi, bcast(xk + (size_t)r * QLD(K) + 16));
                }
            }
            for (int r = 0; r < R; r++) is[r] = _mm512_add_epi32(is[r], ih[r]);
            const __m512 sc = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 2048 + 16 * j)))));
            const __m512 mn = _mm512_mul_ps(dm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 2176 + 16 * j)))));
            for (int r = 0; r < R; r++) {
                const size_t i = (size_t)r * nb + s * 8 + j;
                accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(sc, _mm512_set1_ps(xd[i])), accf[r]);
                accf[r] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xs[i]), accf[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)r * ldy, accf[r]);
}

static inline __attribute__((always_inline)) void tile_q6k(const uint8_t *w, int nsb, const int8_t *x, const float *xd,
                                                            const void *sums, int K, float *y, int ldy, int R) {
    const int16_t *s16 = sums;  // the sum of each 16 inputs (the -32 offset's term)
    const int nb = K / 32;
    const __m512i lo4 = _mm512_set1_epi8(15), hi2 = _mm512_set1_epi8(0x30);
    __m512 accf[RT];
    for (int r = 0; r < R; r++) accf[r] = _mm512_setzero_ps();
    for (int s = 0; s < nsb; s++, w += 3392) {
        const __m512 d = _mm512_loadu_ps((const float *)(w + 3328));
        for (int j = 0; j < 8; j++) {  // 32 inputs: sub-blocks 2j and 2j + 1, one activation scale
            __m512i ia[RT], ib[RT];
            for (int r = 0; r < R; r++) ia[r] = ib[r] = _mm512_setzero_si512();
            const __m512i H0 = _mm512_loadu_si512(w + 2048 + j * 128), H1 = _mm512_loadu_si512(w + 2048 + j * 128 + 64);
            for (int v = 0; v < 4; v++) {
                _mm_prefetch((const char *)w + QPF + (j * 4 + v) * 106, _MM_HINT_T0);
                const __m512i L = _mm512_loadu_si512(w + (j * 4 + v) * 64);
                // bits 2v, 2v + 1 of each high-bits byte to bits 4, 5 (16-bit shifts keep them in their byte)
                const __m512i ha = v < 2 ? _mm512_slli_epi16(H0, 4 - 2 * v) : _mm512_srli_epi16(H0, 2 * v - 4);
                const __m512i hb = v < 2 ? _mm512_slli_epi16(H1, 4 - 2 * v) : _mm512_srli_epi16(H1, 2 * v - 4);
                const __m512i Wa = _mm512_or_si512(_mm512_and_si512(L, lo4), _mm512_and_si512(ha, hi2));
                const __m512i Wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), lo4), _mm512_and_si512(hb, hi2));
                const int8_t *xk = x + s * 256 + 32 * j + 4 * v;
                for (int r = 0; r < R; r++) {
                    ia[r] = _mm512_dpbusd_epi32(ia[r], Wa, bcast(xk + (size_t)r * QLD(K)));
                    ib[r] = _mm512_dpbusd_epi32(ib[r], Wb, bcast(xk + (size_t)r * QLD(K) + 16));
                }
            }
            const __m128i a16 = _mm_loadu_si128((const __m128i *)(w + 3072 + 32 * j)), b16 = _mm_loadu_si128((const __m128i *)(w + 3088 + 32 * j));
            const __m512i sa = _mm512_cvtepi8_epi32(a16), sb = _mm512_cvtepi8_epi32(b16);
            const __m512i sp = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a16, b16), _mm_unpacklo_epi8(a16, b16)));
            for (int r = 0; r < R; r++) {
                int pair;
                memcpy(&pair, s16 + (size_t)r * 2 * nb + s * 16 + 2 * j, 4);
                __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(ia[r], sa), _mm512_mullo_epi32(ib[r], sb));
                t = _mm512_sub_epi32(t, _mm512_slli_epi32(_mm512_madd_epi16(sp, _mm512_set1_epi32(pair)), 5));
                accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(xd[(size_t)r * nb + s * 8 + j])), accf[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)r * ldy, accf[r]);
}

static inline __attribute__((always_inline)) void tile_q80(const uint8_t *w, int nsb, const int8_t *x, const float *xd,
                                                            const void *sums, int K, float *y, int ldy, int R) {
    const int16_t *s32 = sums;
    __m512 accf[RT];
    for (int r = 0; r < R; r++) accf[r] = _mm512_setzero_ps();
    for (int s = 0; s < nsb; s++, w += 576) {
        __m512i is[RT], ih[RT];
        for (int r = 0; r < R; r++) is[r] = ih[r] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            _mm_prefetch((const char *)w + QPF + v * 144, _MM_HINT_T0);
            const __m512i W0 = _mm512_loadu_si512(w + v * 64), W1 = _mm512_loadu_si512(w + (v + 4) * 64);
            const int8_t *xk = x + s * 32 + 4 * v;
            for (int r = 0; r < R; r++) {
                is[r] = _mm512_dpbusd_epi32(is[r], W0, bcast(xk + (size_t)r * QLD(K)));
                ih[r] = _mm512_dpbusd_epi32(ih[r], W1, bcast(xk + (size_t)r * QLD(K) + 16));
            }
        }
        for (int r = 0; r < R; r++) is[r] = _mm512_add_epi32(is[r], ih[r]);
        __m512 d = _mm512_loadu_ps((const float *)(w + 512));
        for (int r = 0; r < R; r++) {  // the weights came as q + 128
            __m512i t = _mm512_sub_epi32(is[r], _mm512_set1_epi32(128 * (int)s32[(size_t)r * (K / 32) + s]));
            accf[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(xd[(size_t)r * nsb + s])), accf[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (size_t)r * ldy, accf[r]);
}

#define TILE_CASES(FN, SUMS) \
    switch (R) { \
    case 6: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 6); break; \
    case 5: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 5); break; \
    case 4: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 4); break; \
    case 3: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 3); break; \
    case 2: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 2); break; \
    default: FN(w, nsb, xq, xd, SUMS, K, yt, ldy, 1); }

// Panel p's tiles for rows m0 .. m1 - 1 (activations as xinfer_qg_quant left them) into y (ldy apart).
static void qg_panel(int kind, const uint8_t *w, int K, const int8_t *q, const float *d, const int16_t *s16,
                     const int16_t *s32, const float *xs, int m0, int m1, float *y, int ldy) {
    const int nsb = K / SB[kind];
    for (int r0 = m0; r0 < m1; r0 += RT) {
        const int R = m1 - r0 < RT ? m1 - r0 : RT;
        const int8_t *xq = q + (size_t)r0 * QLD(K);
        const float *xd = d + (size_t)r0 * (K / 32);
        float *yt = y + (size_t)r0 * ldy;
        if (kind == 0) { const float *ss = xs + (size_t)r0 * (K / 32); TILE_CASES(tile_q4k, ss) }
        else if (kind == 1) { const int16_t *ss = s16 + (size_t)r0 * (K / 16); TILE_CASES(tile_q6k, ss) }
        else { const int16_t *ss = s32 + (size_t)r0 * (K / 32); TILE_CASES(tile_q80, ss) }
    }
}

// y [M, ldy] columns 0 .. N - 1 = the quantized activations (xinfer_qg_quant) times the packed weights
// [N, K]^T. Panels split over the threads; within a thread, each panel's tiles of RT rows reuse its
// weights from cache.
void xinfer_qg_mm(int kind, const uint8_t *pw, int N, int K, const int8_t *q, const float *d, const int16_t *s16,
                  const int16_t *s32, const float *xs, int M, float *y, int ldy) {
    const size_t pb = (size_t)(K / SB[kind]) * SB_BYTES[kind];
    // rows in chunks whose activations stay in L2 while every panel passes over them
    const int chunk = M <= 64 ? M : 64;
    #pragma omp parallel
    for (int m0 = 0; m0 < M; m0 += chunk) {
        const int m1 = m0 + chunk < M ? m0 + chunk : M;
        #pragma omp for schedule(static) nowait
        for (int p = 0; p < N / 16; p++) qg_panel(kind, pw + p * pb, K, q, d, s16, s32, xs, m0, m1, y + 16 * p, ldy);
    }
}

// A packed linear as the one-call decode step reads it (ops/cpu_decode.py): up to 3 parts along N.
typedef struct { int n_parts, kind[3], N[3]; const uint8_t *pw[3]; } qg_linear;

// y [M, N] = x [M, K] w^T (+ bias) by every thread of the enclosing parallel region (mm_team in
// ops/cpu_kernels.c): one thread quantizes the rows, then the panels of all parts are shared out.
void xinfer_qg_team(const qg_linear *w, const float *bias, const float *x, float *y, int M, int N, int K) {
    int8_t *q = NULL;
    const size_t nb = (size_t)M * (K / 32);
    #pragma omp single copyprivate(q)
    {
        q = malloc((size_t)M * QLD(K) + nb * (2 * sizeof(float) + 3 * sizeof(int16_t)) + 64);
        float *d = (float *)(q + (size_t)M * QLD(K));
        xinfer_qg_quant(x, M, K, q, d, (int16_t *)(d + 2 * nb), (int16_t *)(d + 2 * nb) + 2 * nb, d + nb);
    }
    const float *d = (const float *)(q + (size_t)M * QLD(K)), *xs = d + nb;
    const int16_t *s16 = (const int16_t *)(d + 2 * nb), *s32 = s16 + 2 * nb;
    int total = 0;
    for (int i = 0; i < w->n_parts; i++) total += w->N[i] / 16;
    #pragma omp for schedule(static)
    for (int g = 0; g < total; g++) {
        int i = 0, p = g, col = 0;
        while (p >= w->N[i] / 16) { p -= w->N[i] / 16; col += w->N[i]; i++; }
        const int kind = w->kind[i];
        float *yp = y + col + 16 * p;
        qg_panel(kind, w->pw[i] + (size_t)p * (K / SB[kind]) * SB_BYTES[kind], K, q, d, s16, s32, xs, 0, M, yp, N);
        if (bias)
            for (int r = 0; r < M; r++)
                for (int c = 0; c < 16; c++) yp[(size_t)r * N + c] += bias[col + 16 * p + c];
    }
    #pragma omp single
    free(q);
}
#else
void xinfer_qg_mm(int kind, const uint8_t *pw, int N, int K, const int8_t *q, const float *d, const int16_t *s16,
                  const int16_t *s32, const float *xs, int M, float *y, int ldy) {
    (void)kind; (void)pw; (void)N; (void)K; (void)q; (void)d; (void)s16; (void)s32; (void)xs; (void)M; (void)y; (void)ldy;
}
void xinfer_qg_team(const void *w, const float *bias, const float *x, float *y, int M, int N, int K) {
    (void)w; (void)bias; (void)x; (void)y; (void)M; (void)N; (void)K;
}
#endif
