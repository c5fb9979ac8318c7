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
//   q8: 32 signed bytes a block; gs (1 or 2) scales a block, each for 32 / gs weights: d[n, b * gs + j]
//       float32, and m[n, b * gs + j] or none: w = d * q + m (Q8_0: gs 1, no m; Q6_K, NVFP4: gs 2; the
//       other K-quants and Q5 types, with or without m).
// Built with -O3 -march=native (AVX-512 or AVX2 + FMA) -fopenmp by ops/cpu_kernels.py; the threads are torch's OpenMP pool.
#include <immintrin.h>
#include <omp.h>
#include <string.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define MR 4  // activation rows per pass over the weights

// `rows` a constant in each case, so the accumulators stay in registers
#define ROWS_CASES(CALL) \
    switch (rows) { case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break; \
                    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; default: CALL(8); }

// A q8 block's scales: block i (row n * nb + b) has gs of them; without m, fma(q, d, 0) is q * d exactly.
typedef struct { float d0, d1, m0, m1; } q8_scales;
static inline q8_scales q8_at(const float *d, const float *mn, size_t i, int gs) {
    const size_t j = i * gs, k = j + gs - 1;
    q8_scales s = {d[j], d[k], mn ? mn[j] : 0.f, mn ? mn[k] : 0.f};
    return s;
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

#if defined(__AVX512F__)
#define SIMD_WIDTH 512

static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// One 32-weight block rebuilt as the GGUF reference does it: weights 0-15 in w0, 16-31 in w1.
static inline void q4_block(const uint8_t *q, float d, float m, __m512 *w0, __m512 *w1) {
    const __m128i low = _mm_set1_epi8(0x0F), raw = _mm_loadu_si128((const __m128i *)q);
    const __m512 dv = _mm512_set1_ps(d), mv = _mm512_set1_ps(m);
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))), dv, mv);
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low))), dv, mv);
}

static inline void q8_block(const int8_t *q, q8_scales s, __m512 *w0, __m512 *w1) {
    *w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))),
                          _mm512_set1_ps(s.d0), _mm512_set1_ps(s.m0));
    *w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))),
                          _mm512_set1_ps(s.d1), _mm512_set1_ps(s.m1));
}

static inline void q4_rows(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y,
                           int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    __m512 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *q = qs + (size_t)n * nb * 16;
    for (int b = 0; b < nb; b++) {
        __m512 w0, w1;
        q4_block(q + b * 16, d[(size_t)n * nb + b], mn[(size_t)n * nb + b], &w0, &w1);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

static inline void q8_rows(const int8_t *qs, const float *d, const float *mn, int gs, const float *x, float *y,
                           int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    __m512 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *q = qs + (size_t)n * K;
    for (int b = 0; b < nb; b++) {
        __m512 w0, w1;
        q8_block(q + b * 32, q8_at(d, mn, (size_t)n * nb + b, gs), &w0, &w1);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            acc[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc[r]);
            acc[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

// r[c] = the 16 rows' value c: a 16 x 16 transpose of 32-bit values.
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2)
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int i = 0; i < 16; i += 4) {  // u[i + e]: rows i .. i + 3's value 4l + e in 128-bit lane l
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]), u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]), u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int e = 0; e < 4; e++) {
        const __m512i a = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x44), b = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xEE);
        const __m512i c = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x44), d = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xEE);
        r[e] = _mm512_shuffle_i32x4(a, c, 0x88), r[4 + e] = _mm512_shuffle_i32x4(a, c, 0xDD);
        r[8 + e] = _mm512_shuffle_i32x4(b, d, 0x88), r[12 + e] = _mm512_shuffle_i32x4(b, d, 0xDD);
    }
}

#if defined(__AVX512BF16__)
// --cpu-matmul bfloat16 on a CPU with AVX512_BF16: the same weights, rounded to bfloat16 with the
// activations, on the dot-product units (32 products an instruction against 16 FMAs): twice the
// arithmetic where several rows make the step compute-bound (batched decode, speculative
// verification). Each row's sums do not depend on the other rows, so a sequence gets the same
// numbers whatever it is batched with.
#define HAS_BF16 1
#define MRB 8  // rows per pass here: the dot products are cheap next to rebuilding the weights

static inline void to_bf16(const float *x, uint16_t *xb, int n) {  // n a multiple of 16
    for (int i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(xb + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
}

// A q4 block as 32 bfloat16 weights, bit-identical to q4_block + cvtne2ps_pbh: the 16 values
// d * j + m a block can hold are rounded once into a table, and the nibbles pick from it (four
// 512-bit ops a block instead of eight: one row's matmuls are bound by these as much as by memory).
static inline __m512bh q4_block_bf16(const uint8_t *q, float d, float m) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i tab = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m)));
    const __m128i low = _mm_set1_epi8(0x0F), raw = _mm_loadu_si128((const __m128i *)q);
    const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(raw, low)),
                                                _mm_and_si128(_mm_srli_epi16(raw, 4), low), 1);
    return (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(nib), _mm512_castsi256_si512(tab));
}

static inline __attribute__((always_inline)) void q4_rows_bf16(const uint8_t *qs, const float *d, const float *mn, const uint16_t *xb, float *y,
                                int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    __m512 acc[MRB];
    for (int r = 0; r < MRB; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t *q = qs + (size_t)n * nb * 16;
    for (int b = 0; b < nb; b++) {
        const __m512bh w = q4_block_bf16(q + b * 16, d[(size_t)n * nb + b], mn[(size_t)n * nb + b]);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(xb + (size_t)r * K + b * 32));
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

static inline __attribute__((always_inline)) void q8_rows_bf16(const int8_t *qs, const float *d, const float *mn, int gs,
                                const uint16_t *xb, float *y, int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    __m512 acc[MRB];
    for (int r = 0; r < MRB; r++) acc[r] = _mm512_setzero_ps();
    const int8_t *q = qs + (size_t)n * K;
    for (int b = 0; b < nb; b++) {
        __m512 w0, w1;
        q8_block(q + b * 32, q8_at(d, mn, (size_t)n * nb + b, gs), &w0, &w1);
        __m512bh w = _mm512_cvtne2ps_pbh(w1, w0);
        for (int r = 0; r < rows; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_loadu_si512(xb + (size_t)r * K + b * 32));
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}


// Weights in 16-column panels (xinfer_panels), for the bfloat16 kernels: per 16 output columns,
// per 32-weight block, per pair of inputs (k, k + 1), the 32 weights of one dot-product
// instruction: lanes 0-15 are columns 0-7 (k and k + 1 side by side), lanes 16-31 columns 8-15.
// q4 (kind 0): 32 bytes for two pairs, lane j in byte j's low nibble for the even pair and in its
// high nibble for the odd one; q8 (1): 32 signed bytes a pair. d and m per (panel, block) as 16
// floats (m 0 for q8 without offsets). q4 panels are read as exact integers (panel_dot_q4x). For
// q8, integer conversions, two FMAs and one rounding make the bfloat16 weights (the same values as
// the q8_block ones), which every row then uses: one weight stream a thread, read once a call, and
// no horizontal sums.
// Panel p of block b's 32 bfloat16 weights, q8 (d0 / m0: columns 0-7's scales and offsets, each
// twice; d1 / m1: columns 8-15's).
static inline __attribute__((always_inline)) __m512bh panel_weights(const uint8_t *q, int b, int p, __m512 d0,
                                                                    __m512 d1, __m512 m0, __m512 m1) {
    const int8_t *w8 = (const int8_t *)q + ((size_t)b * 16 + p) * 32;
    const __m512i i0 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)w8));
    const __m512i i1 = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w8 + 16)));
    const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), d0, m0);
    const __m512 c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), d1, m1);
    return _mm512_cvtne2ps_pbh(c, a);
}

// Calls panel_weights for every (block, pair) of a panel (q: the caller's): BODY sees b, p and w.
#define PANEL_FOR_EACH(dn, mn, nb, BODY)                                                                   \
    do {                                                                                                   \
        const __m512i dup0 = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);            \
        const __m512i dup1 = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15); \
        for (int b = 0; b < (nb); b++) {                                                                   \
            const __m512 d = _mm512_loadu_ps((dn) + b * 16), m = _mm512_loadu_ps((mn) + b * 16);           \
            const __m512 d0 = _mm512_permutexvar_ps(dup0, d), d1 = _mm512_permutexvar_ps(dup1, d);         \
            const __m512 m0 = _mm512_permutexvar_ps(dup0, m), m1 = _mm512_permutexvar_ps(dup1, m);         \
            for (int p = 0; p < 16; p++) {                                                                 \
                const __m512bh w = panel_weights(q, b, p, d0, d1, m0, m1);                                 \
                BODY;                                                                                      \
            }                                                                                              \
        }                                                                                                  \
    } while (0)

#define PANEL_ROWS 16  // rows a pass: 16 accumulators
#define Q4X_ROWS 8     // panel_dot_q4x's: a block's sums and the totals, 16 registers (ROWS_CASES's eight)

// acc[r] += row r's inputs (2p, 2p + 1) times w; xt: a pass's rows pair by pair, ld apart (panel_acts),
// so the broadcasts come from one line.
#define PANEL_DOTS(acc, w, xt, ld, p, rows) \
    for (int r = 0; r < (rows); r++)        \
    acc[r] = _mm512_dpbf16_ps(acc[r], w, (__m512bh)_mm512_set1_epi32((int)(xt)[(size_t)(p) * (ld) + r]))

// The rows x [M, K] rounded to bfloat16 as the panels read them: pass by pass (PANEL_ROWS rows), pair
// of inputs by pair, the pass's rows side by side, ld = min(M, PANEL_ROWS) apart (zeros past M). One
// row is its own pairs.
// sx (or NULL): the rounded rows' sums, 32 inputs (a q4 block) at a time, sx[(i * K / 32 + b) * ld + r]
// for pass i's row r (panel_dot_q4x).
static uint32_t *panel_acts(const float *x, int M, int K, int *ld, float *sx) {
    const int kp = K / 2, np = (M + PANEL_ROWS - 1) / PANEL_ROWS, R = M < PANEL_ROWS ? M : PANEL_ROWS;
    const __mmask16 keep = (__mmask16)((1u << R) - 1);
    uint32_t *xt = aligned_alloc(64, sizeof(uint32_t) * (((size_t)np * kp * R + 15) / 16 * 16));
    *ld = R;
    for (int i = 0; i < np; i++)
        for (int p0 = 0; p0 < kp; p0 += 16) {
            uint32_t *dst = xt + ((size_t)i * kp + p0) * R;
            const float *x0 = x + (size_t)i * PANEL_ROWS * K + 2 * p0;
            float *sums = sx ? sx + ((size_t)i * (K / 32) + p0 / 16) * R : NULL;
            const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
#define BLOCK_SUM(v) _mm512_reduce_add_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)(v), ones))
            if (R == 1) {
                const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x0 + 16), _mm512_loadu_ps(x0));
                _mm512_storeu_si512(dst, v);
                if (sums) sums[0] = BLOCK_SUM(v);
                continue;
            }
            __m512i r[16];
            for (int j = 0; j < 16; j++)  // all 16 each time: the array stays in registers
                r[j] = j < R && i * PANEL_ROWS + j < M
                           ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x0 + (size_t)j * K + 16), _mm512_loadu_ps(x0 + (size_t)j * K))
                           : _mm512_setzero_si512();
            if (sums)
                for (int j = 0; j < R; j++) sums[j] = BLOCK_SUM(r[j]);
#undef BLOCK_SUM
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_mask_storeu_epi32(dst + (size_t)c * R, keep, r[c]);
        }
    return xt;
}

static inline __attribute__((always_inline)) void panel_store(const __m512 *acc, float *y, int ldy, const float *bias,
                                                              int rows) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(y + (size_t)r * ldy, _mm512_add_ps(acc[r], bv));
}

// One pass of `rows` rows against a q8 panel, its weights rebuilt as they are read (the layout above).
static inline __attribute__((always_inline)) void panel_dot(const uint8_t *q, const float *dn, const float *mn,
                                                           const uint32_t *xt, int ld, float *y, int K, int ldy,
                                                           const float *bias, int rows) {
    __m512 acc[PANEL_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    PANEL_FOR_EACH(dn, mn, K / 32, PANEL_DOTS(acc, w, xt, ld, b * 16 + p, rows));
    panel_store(acc, y, ldy, bias, rows);
}

// One pass of q4 panels with the nibbles as exact bfloat16 integers: the bits 0x4180 | q << 3 are
// 16 + q, so a weight vector is two integer operations, none on the units the dot products need
// (panel_dot converts, scales and rounds on them). Each block's sums are scaled once a row instead:
// d * sum x (16 + q) + (m - 16 d) * sum x, sx the rounded inputs' block sums (panel_acts). The
// weights are not rounded.
static inline __attribute__((always_inline)) void panel_dot_q4x(const uint8_t *q, const float *dn, const float *mn,
                                                               const uint32_t *xt, int ld, const float *sx, float *y,
                                                               int K, int ldy, const float *bias, int rows) {
    const __m512i mask = _mm512_set1_epi16(0x78), base = _mm512_set1_epi16(0x4180);
    __m512 tot[Q4X_ROWS];
    for (int r = 0; r < rows; r++) tot[r] = _mm512_setzero_ps();
    for (int b = 0; b < K / 32; b++) {
        __m512 acc[Q4X_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int p = 0; p < 16; p += 2) {
            const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + ((size_t)b * 8 + p / 2) * 32)));
            const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, base, 0xEA);  // (a & b) | c
            PANEL_DOTS(acc, w0, xt, ld, b * 16 + p, rows);
            const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, base, 0xEA);
            PANEL_DOTS(acc, w1, xt, ld, b * 16 + p + 1, rows);
        }
        const __m512 d = _mm512_loadu_ps(dn + b * 16);
        const __m512 m = _mm512_fnmadd_ps(_mm512_set1_ps(16.f), d, _mm512_loadu_ps(mn + b * 16));
        for (int r = 0; r < rows; r++)
            tot[r] = _mm512_fmadd_ps(acc[r], d, _mm512_fmadd_ps(m, _mm512_set1_ps(sx[b * ld + r]), tot[r]));
    }
    panel_store(tot, y, ldy, bias, rows);
}

// A q8 panel's bfloat16 weights written out once (K / 2 vectors) for batches of several passes: each
// pass then reads them back instead of rebuilding them.
static void panel_unpack(const uint8_t *q, const float *dn, const float *mn, int K, __m512bh *wb) {
    PANEL_FOR_EACH(dn, mn, K / 32, wb[b * 16 + p] = w);
}

// panel_dot on unpacked weights (panel_unpack).
static inline __attribute__((always_inline)) void panel_dot_bf16(const __m512bh *wb, const uint32_t *xt, int ld,
                                                                 float *y, int K, int ldy, const float *bias, int rows) {
    __m512 acc[PANEL_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        const __m512bh w = wb[p];
        PANEL_DOTS(acc, w, xt, ld, p, rows);
    }
    panel_store(acc, y, ldy, bias, rows);
}

// panel_dot_bf16 on two panels at once, up to Q4X_ROWS rows: each broadcast input pair feeds both, so a
// dot product costs half the loads (plain bfloat16 weights, the big batches' GEMM).
static inline __attribute__((always_inline)) void panel_dot_bf16x2(const __m512bh *wa, const __m512bh *wb,
                                                                   const uint32_t *xt, int ld, float *ya, float *yb,
                                                                   int K, int ldy, const float *ba, const float *bb,
                                                                   int rows) {
    __m512 a[Q4X_ROWS], b[Q4X_ROWS];
    for (int r = 0; r < rows; r++) a[r] = b[r] = _mm512_setzero_ps();
    for (int p = 0; p < K / 2; p++) {
        const __m512bh u = wa[p], v = wb[p];
        for (int r = 0; r < rows; r++) {
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)xt[(size_t)p * ld + r]);
            a[r] = _mm512_dpbf16_ps(a[r], u, x);
            b[r] = _mm512_dpbf16_ps(b[r], v, x);
        }
    }
    panel_store(a, ya, ldy, ba, rows);
    panel_store(b, yb, ldy, bb, rows);
}

// CALL(R) with R = rows (1 .. PANEL_ROWS) a compile-time constant: the accumulators stay in registers.
#define PANEL_CASES(CALL)                                                                                   \
    switch (rows) {                                                                                         \
    case 1: CALL(1); break; case 2: CALL(2); break; case 3: CALL(3); break; case 4: CALL(4); break;          \
    case 5: CALL(5); break; case 6: CALL(6); break; case 7: CALL(7); break; case 8: CALL(8); break;          \
    case 9: CALL(9); break; case 10: CALL(10); break; case 11: CALL(11); break; case 12: CALL(12); break;    \
    case 13: CALL(13); break; case 14: CALL(14); break; case 15: CALL(15); break; default: CALL(16);         \
    }

// gcc turns the accumulators' zeroing into a memset of the array before keeping them in registers
// anyway: ~1% of a 64-row decode step in calls (perf), without loop-pattern distribution here.
#if defined(__GNUC__) && !defined(__clang__)
#define NO_MEMSET __attribute__((optimize("no-tree-loop-distribute-patterns")))
#else
#define NO_MEMSET
#endif

// q8 panels in one pass (q4 ones take panel_rows_q4x)
NO_MEMSET static void panel_rows_q8(const uint8_t *q, const float *dn, const float *mn, const uint32_t *xb, int ld,
                                    float *y, int K, int ldy, const float *bias, int rows) {
#define QP(R) panel_dot(q, dn, mn, xb, ld, y, K, ldy, bias, R)
    PANEL_CASES(QP);
#undef QP
}

NO_MEMSET static void panel_rows_q4x(const uint8_t *q, const float *dn, const float *mn, const uint32_t *xb, int ld,
                                     const float *sx, float *y, int K, int ldy, const float *bias, int rows) {
#define QP(R) panel_dot_q4x(q, dn, mn, xb, ld, sx, y, K, ldy, bias, R)
    if (rows > Q4X_ROWS) {  // two passes, the weights rebuilt for each (measured faster than totals in memory)
        panel_rows_q4x(q, dn, mn, xb, ld, sx, y, K, ldy, bias, Q4X_ROWS);
        xb += Q4X_ROWS, sx += Q4X_ROWS, y += (size_t)Q4X_ROWS * ldy, rows -= Q4X_ROWS;
    }
    ROWS_CASES(QP);  // 1 .. Q4X_ROWS
#undef QP
}

NO_MEMSET static void panel_rows_bf16(const __m512bh *wb, const uint32_t *xb, int ld, float *y, int K, int ldy,
                            const float *bias, int rows) {
#define QP(R) panel_dot_bf16(wb, xb, ld, y, K, ldy, bias, R)
    PANEL_CASES(QP);
#undef QP
}

NO_MEMSET static void panel_rows_bf16x2(const __m512bh *wa, const __m512bh *wb, const uint32_t *xb, int ld, float *ya,
                                        float *yb, int K, int ldy, const float *ba, const float *bb, int rows) {
#define QP(R) panel_dot_bf16x2(wa, wb, xb, ld, ya, yb, K, ldy, ba, bb, R)
    ROWS_CASES(QP);
#undef QP
}


#endif
#elif defined(__AVX2__) && defined(__FMA__)
// The same two kernels in 8-wide AVX2 (+ FMA): weights rebuilt the same way, eight at a time.
#define SIMD_WIDTH 256

static inline float hsum(__m256 v) { return hsum8(v); }

static inline void q4_rows(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y,
                           int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    const __m128i low = _mm_set1_epi8(0x0F);
    __m256 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *q = qs + (size_t)n * nb * 16;
    for (int b = 0; b < nb; b++) {
        __m128i raw = _mm_loadu_si128((const __m128i *)(q + b * 16));
        __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        __m256 dv = _mm256_set1_ps(d[(size_t)n * nb + b]), mv = _mm256_set1_ps(mn[(size_t)n * nb + b]);
        __m256 w[4];  // weights 0-7, 8-15 (low nibbles), 16-23, 24-31 (high nibbles)
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), dv, mv);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), dv, mv);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), dv, mv);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), dv, mv);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            for (int j = 0; j < 4; j++) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}

static inline void q8_rows(const int8_t *qs, const float *d, const float *mn, int gs, const float *x, float *y,
                           int rows, int n, int K, int ldy) {
    const int nb = K / 32;
    __m256 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    const int8_t *q = qs + (size_t)n * K;
    for (int b = 0; b < nb; b++) {
        const q8_scales sc = q8_at(d, mn, (size_t)n * nb + b, gs);  // weights 0-15: d0, m0; 16-31: d1, m1
        __m256 w[4];
        for (int j = 0; j < 4; j++)
            w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + b * 32 + 8 * j)))),
                                   _mm256_set1_ps(j < 2 ? sc.d0 : sc.d1), _mm256_set1_ps(j < 2 ? sc.m0 : sc.m1));
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (size_t)r * K + b * 32;
            for (int j = 0; j < 4; j++) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) y[(size_t)r * ldy + n] = hsum(acc[r]);
}
#else
#error "the CPU kernels need AVX-512 or AVX2 with FMA"
#endif
#ifndef HAS_BF16
#define HAS_BF16 0
#endif

int xinfer_simd_width(void) { return SIMD_WIDTH; }
int xinfer_has_bf16(void) { return HAS_BF16; }

// --cpu-matmul int16: the activations quantized per 32 values to 16 bits (d = max |x| / 32767, q = x / d
// rounded to nearest) and multiplied with the blocks' own integers, widened to 16 bits, by integer
// multiply-adds (vpmaddwd: 16 products and 8 sums an instruction, where the float kernels rebuild
// each weight in float32 first: about half the instructions a block for one row). Each block's
// products are summed exactly in int32 and scaled by d_w * d_x; the offsets m multiply the exact
// float sums of x. 8-bit activations (llama.cpp's) failed the fidelity budget here: mean KLD 0.015
// (bench/NOTES-cpu.md). AVX2 instructions, so the AVX-512 builds have it too.
typedef struct {
    int16_t *q;          // [M, K]
    float *d, *s1, *s2;  // [M, K / 32]: scale and sum of x a block; s2 [M, K / 16]: sums of its halves
} xq_act;

// Blocks i0 .. i1 - 1 of x (row-major, 32 values a block).
static void quant_blocks(const float *x, size_t i0, size_t i1, xq_act *a) {
    for (size_t i = i0; i < i1; i++) {
        const float *xb = x + i * 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            v[j] = _mm256_loadu_ps(xb + 8 * j);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[j]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
        const __m256 id = _mm256_set1_ps(amax > 0.f ? 32767.f / amax : 0.f);
        for (int j = 0; j < 4; j += 2) {  // nearest, ties to even; packs interleaves 128-bit lanes, 0xD8 undoes it
            const __m256i n = _mm256_packs_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(v[j], id)),
                                                 _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], id)));
            _mm256_storeu_si256((__m256i *)(a->q + i * 32 + 8 * j), _mm256_permute4x64_epi64(n, 0xD8));
        }
        a->d[i] = amax / 32767.f;
        const float h0 = hsum8(_mm256_add_ps(v[0], v[1])), h1 = hsum8(_mm256_add_ps(v[2], v[3]));
        a->s2[2 * i] = h0, a->s2[2 * i + 1] = h1, a->s1[i] = h0 + h1;
    }
}

static void quant_act(const float *x, int M, int K, xq_act *a) { quant_blocks(x, 0, (size_t)M * (K / 32), a); }

// The activations' buffers laid out in `buf` (int16 values, then d, s1, s2).
static xq_act act_view(void *buf, int M, int K) {
    const size_t nb = (size_t)M * (K / 32);
    xq_act a = {buf, (float *)((int16_t *)buf + (size_t)M * K), NULL, NULL};
    a.s1 = a.d + nb, a.s2 = a.d + 2 * nb;
    return a;
}

static xq_act act_alloc(int M, int K) {
    const size_t nb = (size_t)M * (K / 32);
    xq_act a = {malloc(sizeof(int16_t) * (size_t)M * K), malloc(sizeof(float) * nb * 4), NULL, NULL};
    a.s1 = a.d + nb, a.s2 = a.d + 2 * nb;
    return a;
}

static inline float dotf(const float *a, const float *b, int n) {
    __m256 s = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum8(s);
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

// Rows r0 .. r0 + rows - 1 of the activations against output n, for q4 (kind 0) or q8 weights.
static inline __attribute__((always_inline)) void rows_i16(const void *qs, const float *d, const float *mn, int kind,
                                                          int gs, const xq_act *a, int r0, float *y, int rows, int n,
                                                          int K, int ldy) {
    const int nb = K / 32;
    __m256 acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm256_setzero_ps();
    const float *dn = d + (size_t)n * nb * gs;
    for (int b = 0; b < nb; b++) {
        __m256i w0, w1;  // weights 0-15 and 16-31 as 16-bit integers
        if (kind == 0) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)qs + ((size_t)n * nb + b) * 16));
            const __m128i low = _mm_set1_epi8(0x0F);
            w0 = _mm256_cvtepu8_epi16(_mm_and_si128(raw, low));
            w1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), low));
        } else {
            const int8_t *q = (const int8_t *)qs + ((size_t)n * nb + b) * 32;
            w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
            w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
        }
        const __m256 d0 = _mm256_set1_ps(dn[b * gs]), d1 = _mm256_set1_ps(dn[b * gs + gs - 1]);
        for (int r = 0; r < rows; r++) {
            const size_t i = (size_t)(r0 + r) * nb + b;
            const __m256i *xq = (const __m256i *)(a->q + i * 32);
            const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(xq));
            const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(xq + 1));
            const __m256 dx = _mm256_set1_ps(a->d[i]);
            if (gs == 1) {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_mul_ps(d0, dx), acc[r]);
            } else {
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_mul_ps(d0, dx), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_mul_ps(d1, dx), acc[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float *s = gs == 1 ? a->s1 + (size_t)(r0 + r) * nb : a->s2 + (size_t)(r0 + r) * 2 * nb;
        y[(size_t)r * ldy + n] = hsum8(acc[r]) + (mn ? dotf(mn + (size_t)n * nb * gs, s, nb * gs) : 0.f);
    }
}

// Weights in 8-column panels (xinfer_panels8), for the float32 kernels of the AVX2 build: per 8
// output columns, per 32-weight block, per input k, the 8 columns' weights side by side: q4 (kind 0)
// in a 32-bit word, column c in bits 4c..4c + 3; q8 (1) in 8 signed bytes. d and m per (panel,
// block) as 8 floats (m 0 for q8 without offsets). Each weight is rebuilt once (d * q + m in one
// rounding, the same values as the row kernels') and used by every row of a pass against its
// broadcast activation: one FMA per 8 products, no horizontal sums, one weight stream a thread.
#define PANEL8_ROWS 12  // rows a pass: 12 accumulators, the rest of the 16 registers for the weights
// Twelve named accumulators, those of rows R and up compiled out: as an array, GCC stored every
// accumulator to the stack on each iteration (3x slower).
#define A8_EACH(OP) OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)
#define A8_ZERO(i) __m256 a##i = _mm256_setzero_ps();
#define A8_FMA(i) if (i < rows) a##i = _mm256_fmadd_ps(w, _mm256_broadcast_ss(x + (size_t)i * K + b * 32 + k), a##i);
#define A8_STORE(i) if (i < rows) _mm256_storeu_ps(y + (size_t)i * ldy, _mm256_add_ps(a##i, bv));
#define PANEL8_DOT(KIND, R)                                                                                     \
    static void panel8_##KIND##_##R(const uint8_t *q, const float *dn, const float *mn, const float *x, float *y, \
                                    int K, int ldy, const float *bias) {                                        \
        const int rows = R;                                                                                     \
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), lo = _mm256_set1_epi32(0x0F);  \
        A8_EACH(A8_ZERO)                                                                                        \
        for (int b = 0; b < K / 32; b++) {                                                                      \
            const __m256 d = _mm256_loadu_ps(dn + b * 8), m = _mm256_loadu_ps(mn + b * 8);                      \
            for (int k = 0; k < 32; k++) {                                                                      \
                __m256i qi;                                                                                     \
                if (KIND == 0) {                                                                                \
                    int32_t word;                                                                               \
                    memcpy(&word, q + ((size_t)b * 32 + k) * 4, 4);                                             \
                    qi = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), lo);              \
                } else {                                                                                        \
                    qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + ((size_t)b * 32 + k) * 8))); \
                }                                                                                               \
                const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(qi), d, m);                                 \
                A8_EACH(A8_FMA)                                                                                 \
            }                                                                                                   \
        }                                                                                                       \
        const __m256 bv = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();                                  \
        A8_EACH(A8_STORE)                                                                                       \
    }
#define PANEL8_KINDS(R) PANEL8_DOT(0, R) PANEL8_DOT(1, R)
PANEL8_KINDS(1) PANEL8_KINDS(2) PANEL8_KINDS(3) PANEL8_KINDS(4) PANEL8_KINDS(5) PANEL8_KINDS(6)
PANEL8_KINDS(7) PANEL8_KINDS(8) PANEL8_KINDS(9) PANEL8_KINDS(10) PANEL8_KINDS(11) PANEL8_KINDS(12)

typedef void (*panel8_fn)(const uint8_t *, const float *, const float *, const float *, float *, int, int,
                          const float *);
#define P8(R) {panel8_0_##R, panel8_1_##R}
static const panel8_fn PANEL8[PANEL8_ROWS][2] = {P8(1), P8(2), P8(3), P8(4), P8(5), P8(6),
                                                 P8(7), P8(8), P8(9), P8(10), P8(11), P8(12)};
#undef P8

// --cpu-matmul int16 past INT16_ROWS rows (the AVX2 build): the weights widened once at load to 16 bits
// in 8-column panels (xinfer_panels_i16): per 8 columns, per block, per input pair (k, k + 1), 16
// values, column c's pair in lanes 2c and 2c + 1, which one vpmaddwd multiplies by a broadcast pair of
// activations (16 products, 8 sums: twice an FMA's). Two panels (16 columns) by up to I16P_ROWS rows a
// pass, the int32 sums in named registers; once a block they are scaled by d_w * d_x into y (the pass's
// tile stays in L1) and the offsets m add m * (the block's exact float sum of x). No weight is rebuilt
// per pass: batches of any size run here, prefill too.
#define I16P_ROWS 4
#define I16P_OWN_ROWS 64
#define I_EACH(OP) OP(0) OP(1) OP(2) OP(3)
#define I_ZERO(r) __m256i a##r##0 = _mm256_setzero_si256(), a##r##1 = _mm256_setzero_si256();
#define I_MADD(r)                                                                                      \
    if (r < rows) {                                                                                       \
        const __m256i xv = _mm256_set1_epi32(xp[(size_t)r * (K / 2) + j]);                           \
        a##r##0 = _mm256_add_epi32(a##r##0, _mm256_madd_epi16(w0, xv));                               \
        if (cols == 2) a##r##1 = _mm256_add_epi32(a##r##1, _mm256_madd_epi16(w1, xv));                   \
    }
#define I_SCALE1(r, g)                                                                                 \
    {                                                                                                  \
        float *yr = y + (size_t)r * ldy + 8 * g;                                                       \
        const __m256 t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a##r##g), _mm256_mul_ps(dd##g, dx),         \
                                         _mm256_loadu_ps(yr));                                         \
        _mm256_storeu_ps(yr, _mm256_fmadd_ps(mm##g, sx, t));                                            \
    }
#define I_SCALE(r)                                                                                     \
    if (r < rows) {                                                                                       \
        const size_t i = (size_t)(m0 + r) * nb + b;                                                   \
        const __m256 dx = _mm256_set1_ps(a->d[i]), sx = _mm256_set1_ps(a->s1[i]);                     \
        I_SCALE1(r, 0)                                                                                 \
        if (cols == 2) I_SCALE1(r, 1)                                                                     \
    }
#define I16P_DOT(G, R)                                                                                  \
    static void i16p_##G##_##R(const int16_t *p, const float *pd, const float *pm, const xq_act *a, int m0, \
                               float *y, int K, int ldy, const float *bias) {                          \
        const int nb = K / 32, rows = R, cols = G;                                                      \
        for (int r = 0; r < R; r++)                                                                     \
            for (int c = 0; c < 8 * G; c++) y[(size_t)r * ldy + c] = bias ? bias[c] : 0.f;             \
        for (int b = 0; b < nb; b++) {                                                                  \
            const int16_t *q0 = p + (size_t)b * 256, *q1 = q0 + (size_t)nb * 256;                       \
            const int32_t *xp = (const int32_t *)(a->q + (size_t)m0 * K + b * 32);                      \
            I_EACH(I_ZERO)                                                                              \
            for (int j = 0; j < 16; j++) {                                                              \
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(q0 + j * 16));                   \
                const __m256i w1 = G == 2 ? _mm256_loadu_si256((const __m256i *)(q1 + j * 16)) : w0;     \
                I_EACH(I_MADD)                                                                          \
            }                                                                                           \
            const __m256 dd0 = _mm256_loadu_ps(pd + b * 8), mm0 = _mm256_loadu_ps(pm + b * 8);             \
            const __m256 dd1 = G == 2 ? _mm256_loadu_ps(pd + (nb + b) * 8) : dd0;                       \
            const __m256 mm1 = G == 2 ? _mm256_loadu_ps(pm + (nb + b) * 8) : mm0;                       \
            I_EACH(I_SCALE)                                                                             \
        }                                                                                               \
    }
#define I16P_GS(R) I16P_DOT(1, R) I16P_DOT(2, R)
I16P_GS(1) I16P_GS(2) I16P_GS(3) I16P_GS(4)
typedef void (*i16p_fn)(const int16_t *, const float *, const float *, const xq_act *, int, float *, int, int,
                        const float *);
static const i16p_fn I16P[I16P_ROWS][2] = {{i16p_1_1, i16p_2_1}, {i16p_1_2, i16p_2_2}, {i16p_1_3, i16p_2_3},
                                           {i16p_1_4, i16p_2_4}};

// The weights [N, K] (N a multiple of 8) widened to 16 bits in the panels i16p reads: q4 (kind 0) or q8
// (1) in the row layout; out N * K values.
void xinfer_panels_i16(const uint8_t *qs, int kind, int N, int K, int16_t *out) {
    const int nb = K / 32;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const size_t i = (size_t)n * nb + b;
            int16_t *dst = out + ((size_t)(n / 8) * nb + b) * 256 + (n % 8) * 2;
            for (int k = 0; k < 32; k++)
                dst[(k / 2) * 16 + k % 2] = kind == 0 ? (k < 16 ? qs[i * 16 + k] & 0x0F : qs[i * 16 + k - 16] >> 4)
                                                      : ((const int8_t *)qs)[i * 32 + k];
        }
}

// y [M, N] = x w^T (+ bias) through the int16 panels, by every thread of the enclosing region: the
// activations quantized once, shared (each thread a share of the blocks), then 16-column units.
typedef struct kv_pf kv_pf;
static void pf_step(kv_pf *p);
static void silu_mul(const float *g, const float *u, float *out, int n);

// act [rows b0 .. b1, columns c .. c + 15] = silu(gate) * up from y [M, N] (gate the first N / 2
// columns, up the rest): the epilogue of a turn that computed those columns of both.
static void silu_cols(const float *y, int N, float *act, int b0, int b1, int c) {
    for (int b = b0; b < b1; b++)
        silu_mul(y + (size_t)b * N + c, y + (size_t)b * N + N / 2 + c, act + (size_t)b * (N / 2) + c, 16);
}

// act: as mm_team's (silu(gate) * up written by the thread that made each 16 columns of both); returns
// whether it was.
static int mm_i16p(const int16_t *p, const float *pd, const float *pm, const float *bias, int N, int K,
                   const float *x, float *y, int M, kv_pf *pf, float *act) {
    const int nb = K / 32, units = (N / 8 + 1) / 2, pairs = act ? N / 32 : 0;
    // Up to I16P_OWN_ROWS rows each thread quantizes them all itself (no barrier: a thread that waits
    // at one spins while the server's other processes hold its core); past that they share the work.
    // The buffers are kept across calls (a prefill's few MB, mapped afresh, page-faulted every call).
    static void *shared_buf;
    static size_t shared_cap;
    static __thread void *own_buf;
    static __thread size_t own_cap;
    const int own = M <= I16P_OWN_ROWS;
    const size_t need = sizeof(int16_t) * (size_t)M * K + sizeof(float) * (size_t)M * nb * 4;
    xq_act a;
    if (own) {
        if (need > own_cap) free(own_buf), own_buf = malloc(need), own_cap = need;
        a = act_view(own_buf, M, K);
        quant_act(x, M, K, &a);
    } else {
#pragma omp single copyprivate(a)
        {
            if (need > shared_cap) free(shared_buf), shared_buf = malloc(need), shared_cap = need;
            a = act_view(shared_buf, M, K);
        }
        const size_t blocks = (size_t)M * nb;
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        quant_blocks(x, blocks * t / nt, blocks * (t + 1) / nt, &a);
#pragma omp barrier
    }
    // rows in tiles of ~256 KB of activations, which stay in L2 while each unit's weights pass by
    const int tile = K < 131072 / I16P_ROWS ? 131072 / K / I16P_ROWS * I16P_ROWS : I16P_ROWS;
    for (int t0 = 0; t0 < M; t0 += tile) {
        const int t1 = t0 + tile < M ? t0 + tile : M;
#pragma omp for schedule(static) nowait
        for (int u = 0; u < (pairs ? pairs : units); u++) {
            for (int h = 0; h < (pairs ? 2 : 1); h++) {  // with act: gate unit u, then up unit u + pairs
                const int g = 2 * (u + h * pairs), G = g + 1 < N / 8 ? 2 : 1;
                for (int m0 = t0; m0 < t1; m0 += I16P_ROWS)
                    I16P[(t1 - m0 < I16P_ROWS ? t1 - m0 : I16P_ROWS) - 1][G - 1](
                        p + (size_t)g * nb * 256, pd + (size_t)g * nb * 8, pm + (size_t)g * nb * 8, &a, m0,
                        y + (size_t)m0 * N + g * 8, K, N, bias ? bias + g * 8 : NULL);
                if (pf)
                    for (int i = 0; i < 8 * G; i++) pf_step(pf);  // as often as the row loop of mm_team would
            }
            if (pairs) silu_cols(y, N, act, t0, t1, u * 16);
        }
    }
#pragma omp barrier
    return pairs > 0;
}

// Weights [N, K] (N a multiple of 8) as 8-column panels (panel8_dot), from the row layout: q4 (kind
// 0) or q8 with one scale a block (1); mn NULL: no offsets. pq N * K / 2 (q4) or N * K bytes (NULL:
// the scales alone, for the int16 panels); pd and pm N * K / 32 floats.
void xinfer_panels8(const uint8_t *qs, const float *d, const float *mn, int kind, int N, int K, uint8_t *pq, float *pd,
                    float *pm) {
    const int nb = K / 32;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const size_t blk = (size_t)(n / 8) * nb + b, i = (size_t)n * nb + b;
            const int c = n % 8;
            pd[blk * 8 + c] = d[i], pm[blk * 8 + c] = mn ? mn[i] : 0.f;
            for (int k = 0; pq && k < 32; k++) {
                if (kind == 0) {
                    const uint8_t *src = qs + i * 16;  // weights j and 16 + j in byte j
                    const uint8_t v = k < 16 ? src[k] & 0x0F : src[k - 16] >> 4;
                    uint8_t *dst = pq + (blk * 32 + k) * 4 + c / 2;
                    *dst = c % 2 ? (uint8_t)((*dst & 0x0F) | (v << 4)) : (uint8_t)((*dst & 0xF0) | v);
                } else {
                    pq[(blk * 32 + k) * 8 + c] = qs[i * 32 + k];
                }
            }
        }
}

enum { PREC_F32, PREC_BF16, PREC_INT16 };
#define INT16_ROWS 3  // --cpu-matmul int16 up to this many rows; more reuse each rebuilt weight enough for float32

// A quantized linear as the decode step reads it (ops/cpu_decode.py fills these).
typedef struct {
    const void *qs;
    const float *d, *m, *bias;  // m: q4 only; bias may be NULL
    int kind, N, K;             // kind 0: q4, 1: q8
    int gs;                     // q8: scales per 32-weight block (1 or 2)
    int prec;                   // PREC_*: bfloat16 where HAS_BF16 (else float32), int16 activations
    const uint8_t *pq;          // with bf16: the same weights in panels (panel_dot), or NULL
    const float *pd, *pm;
    const int16_t *pi;          // int16 on AVX2: the weights widened in panels (mm_i16p), or NULL
    const void *qg;             // GGUF weights held as packed blocks alone (ops/cpu_qgemm.c), or NULL
} xq_linear;

void xinfer_qg_team(const void *w, const float *bias, const float *x, float *y, int M, int N, int K);

#if HAS_BF16
static void rows_bf16(const xq_linear *w, const uint16_t *xb, float *y, int rows, int n) {
#define Q4B(R) q4_rows_bf16(w->qs, w->d, w->m, xb, y, R, n, w->K, w->N)
#define Q8B(R) q8_rows_bf16(w->qs, w->d, w->m, w->gs, xb, y, R, n, w->K, w->N)
    if (w->kind == 0) ROWS_CASES(Q4B) else ROWS_CASES(Q8B)
}
#endif

// Lines fetched toward L2 a few at a time while a matmul computes (struct kv_pf below); NULL: none.

// bytes from p fetched toward L2, a line at a time.
static inline void prefetch_l2(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + i, _MM_HINT_T1);
}

// y [M, N] = x [M, K] w^T (+ bias), run by every thread of the enclosing parallel region. act: where
// the bfloat16 panels may also write silu(y[:, :N/2]) * y[:, N/2:] (N/2 a multiple of 16); returns
// whether they did.
static int mm_team(const xq_linear *w, const float *x, float *y, int M, kv_pf *pf, float *act) {
    // Weight-stationary: each thread takes its share of the output rows n and runs every activation
    // row through each in passes of mr rows, so a weight row comes from memory once a call (the
    // later passes find it in L1) however many rows the batch has. Each row's sums are the same
    // whatever rows share its pass.
    if (w->qg) {
        xinfer_qg_team(w->qg, w->bias, x, y, M, w->N, w->K);
        return 0;
    }
    const int i16 = w->prec == PREC_INT16 && M <= INT16_ROWS;
    if (w->prec == PREC_INT16 && w->pi && !i16) {
        return mm_i16p(w->pi, w->pd, w->pm, w->bias, w->N, w->K, x, y, M, pf, act);
    }
#if !HAS_BF16
    if (w->pq && !i16) {  // 8-column panels (the AVX2 build's float32 path)
        const int nb = w->K / 32;
#pragma omp for schedule(static)
        for (int g = 0; g < w->N / 8; g++) {
            for (int m0 = 0; m0 < M; m0 += PANEL8_ROWS)
                PANEL8[(M - m0 < PANEL8_ROWS ? M - m0 : PANEL8_ROWS) - 1][w->kind](
                    w->pq + (size_t)g * (w->kind ? 8 : 4) * w->K, w->pd + (size_t)g * nb * 8, w->pm + (size_t)g * nb * 8,
                    x + (size_t)m0 * w->K, y + (size_t)m0 * w->N + g * 8, w->K, w->N, w->bias ? w->bias + g * 8 : NULL);
            if (pf)
                for (int i = 0; i < 8; i++) pf_step(pf);  // as often as the row loop below would
        }
        return 0;
    }
#endif
    if (i16) {
        // each thread quantizes the rows itself (M * K values): no barrier, no shared buffer
        xq_act a = act_alloc(M, w->K);
        quant_act(x, M, w->K, &a);
#define I16(R) rows_i16(w->qs, w->d, w->m, w->kind, w->gs, &a, m0, ym, R, n, w->K, w->N)
#pragma omp for schedule(static)
        for (int n = 0; n < w->N; n++) {
            for (int m0 = 0; m0 < M; m0 += MR) {
                const int rows = M - m0 < MR ? M - m0 : MR;
                float *ym = y + (size_t)m0 * w->N;
                switch (rows) { case 1: I16(1); break; case 2: I16(2); break; case 3: I16(3); break; default: I16(4); }
                if (w->bias)
                    for (int r = 0; r < rows; r++) ym[(size_t)r * w->N + n] += w->bias[n];
            }
            if (pf) pf_step(pf);
        }
#undef I16
        free(a.q), free(a.d);
        return 0;
    }
#if HAS_BF16
    // each thread rounds the rows itself (M * K values): no barrier, no shared buffer
    if (w->prec == PREC_BF16 && w->pq) {
        const int nb = w->K / 32, np = (M + PANEL_ROWS - 1) / PANEL_ROWS;
        // q4: the nibbles as exact integers, rebuilt every pass (panel_dot_q4x), so a row's sums are
        // the same in every batch these kernels take; q8 with several passes: a panel's weights are
        // rebuilt once, into wb, and read back by every pass
        // kind 2: plain bfloat16 weights (xinfer_bf16_pack), read as they are
        const int plain = w->kind == 2;
        __m512bh *wb = M > PANEL_ROWS && w->kind == 1 ? aligned_alloc(64, sizeof(__m512bh) * (size_t)w->K / 2) : NULL;
        float *sx = w->kind == 0 ? aligned_alloc(64, sizeof(float) * np * nb * PANEL_ROWS) : NULL;
        int ld;
        uint32_t *xt = panel_acts(x, M, w->K, &ld, sx);
        // A turn takes two panels: gate panel t and up panel t + pairs with act (then their 16
        // columns of silu(gate) * up while they are in cache, by the thread that made them: no pass,
        // no barrier), else panels 2t and 2t + 1 (where that leaves an even count of turns, so two
        // threads still split them evenly; else one panel a turn). Its passes run pass by pass over
        // both panels, so a pass's rounded rows stay in L1 for the second panel (the q4 bytes are the
        // smaller reads).
        const int np16 = w->N / 16, pairs = act ? w->N / 32 : 0, per = pairs || np16 % 4 == 0 ? 2 : 1;
        const int turns = pairs ? pairs : np16 / per;
        const size_t qb = (size_t)(plain ? 32 : w->kind ? 16 : 8) * w->K, sb = sizeof(float) * (size_t)nb * 16;  // a panel's
#define PANEL_OF(t, i) ((pairs) ? (t) + (i) * pairs : per * (t) + (i))  // turn t's i-th panel
#pragma omp for schedule(static)
        for (int t = 0; t < turns; t++) {
            for (int i = 0; i < per && M > PANEL_ROWS && t + 1 < turns; i++) {  // the next turn's, while this one computes
                const int g = PANEL_OF(t + 1, i);
                prefetch_l2(w->pq + g * qb, qb);
                if (!plain) prefetch_l2(w->pd + (size_t)g * nb * 16, sb), prefetch_l2(w->pm + (size_t)g * nb * 16, sb);
            }
            for (int i = 0; i < per && wb; i++) {  // q8, several passes: a panel at a time, unpacked once
                const int g = PANEL_OF(t, i);
                panel_unpack(w->pq + g * qb, w->pd + (size_t)g * nb * 16, w->pm + (size_t)g * nb * 16, w->K, wb);
                for (int m0 = 0; m0 < M; m0 += PANEL_ROWS)
                    panel_rows_bf16(wb, xt + (size_t)m0 / PANEL_ROWS * ld * w->K / 2, ld, y + (size_t)m0 * w->N + g * 16,
                                    w->K, w->N, w->bias ? w->bias + g * 16 : NULL, M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS);
            }
            for (int m0 = 0; m0 < M && !wb; m0 += PANEL_ROWS) {
                if (plain && per == 2) {  // both panels of the turn at once, 8 rows a pass
                    const int g0 = PANEL_OF(t, 0), g1 = PANEL_OF(t, 1), rows = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
                    const uint32_t *xp = xt + (size_t)m0 / PANEL_ROWS * ld * w->K / 2;
                    for (int r0 = 0; r0 < rows; r0 += Q4X_ROWS) {
                        float *yr = y + (size_t)(m0 + r0) * w->N;
                        panel_rows_bf16x2((const __m512bh *)(w->pq + g0 * qb), (const __m512bh *)(w->pq + g1 * qb), xp + r0,
                                          ld, yr + g0 * 16, yr + g1 * 16, w->K, w->N, w->bias ? w->bias + g0 * 16 : NULL,
                                          w->bias ? w->bias + g1 * 16 : NULL, rows - r0 < Q4X_ROWS ? rows - r0 : Q4X_ROWS);
                    }
                    continue;
                }
                for (int i = 0; i < per; i++) {
                    const int g = PANEL_OF(t, i), rows = M - m0 < PANEL_ROWS ? M - m0 : PANEL_ROWS;
                    const uint8_t *q = w->pq + g * qb;
                    const float *bias = w->bias ? w->bias + g * 16 : NULL;
                    float *yg = y + (size_t)m0 * w->N + g * 16;
                    const uint32_t *xp = xt + (size_t)m0 / PANEL_ROWS * ld * w->K / 2;
                    if (plain) {
                        panel_rows_bf16((const __m512bh *)q, xp, ld, yg, w->K, w->N, bias, rows);
                        continue;
                    }
                    const float *dn = w->pd + (size_t)g * nb * 16, *mn = w->pm + (size_t)g * nb * 16;
                    if (sx) panel_rows_q4x(q, dn, mn, xp, ld, sx + (size_t)m0 / PANEL_ROWS * nb * ld, yg, w->K, w->N, bias, rows);
                    else panel_rows_q8(q, dn, mn, xp, ld, yg, w->K, w->N, bias, rows);
                }
            }
            if (pf)
                for (int i = 0; i < 16 * per; i++) pf_step(pf);  // as often as the row loop below would
            if (pairs) silu_cols(y, w->N, act, 0, M, t * 16);
        }
#undef PANEL_OF
        free(wb), free(xt), free(sx);
        return pairs > 0;
    }
    uint16_t *xb = w->prec == PREC_BF16 ? malloc(sizeof(uint16_t) * (size_t)M * w->K) : NULL;
    if (xb) to_bf16(x, xb, M * w->K);
    const int mr = xb ? MRB : MR;
#else
    const int mr = MR;
#endif
#pragma omp for schedule(static)
    for (int n = 0; n < w->N; n++) {
        for (int m0 = 0; m0 < M; m0 += mr) {
            const int rows = M - m0 < mr ? M - m0 : mr;
            float *ym = y + (size_t)m0 * w->N;
#if HAS_BF16
            if (xb)
                rows_bf16(w, xb + (size_t)m0 * w->K, ym, rows, n);
            else
#endif
            if (w->kind == 0)
                q4_rows(w->qs, w->d, w->m, x + (size_t)m0 * w->K, ym, rows, n, w->K, w->N);
            else
                q8_rows(w->qs, w->d, w->m, w->gs, x + (size_t)m0 * w->K, ym, rows, n, w->K, w->N);
            if (w->bias)
                for (int r = 0; r < rows; r++) ym[(size_t)r * w->N + n] += w->bias[n];
        }
        if (pf) pf_step(pf);
    }
#if HAS_BF16
    free(xb);
#endif
    return 0;
}

// x [M, K] and y [M, N] row-major float32, K a multiple of 32. pq, pd, pm: the panels, or NULL.
void xinfer_q4_mm(const uint8_t *qs, const float *d, const float *mn, const float *x, float *y, int M, int N, int K,
                  int prec, const uint8_t *pq, const float *pd, const float *pm, const int16_t *pi) {
    const xq_linear w = {qs, d, mn, NULL, 0, N, K, 1, prec, pq, pd, pm, pi};
#pragma omp parallel
    mm_team(&w, x, y, M, NULL, NULL);
}

// Weights [N, K] (N a multiple of 16) as panels (panel_dot): q4 (kind 0, nibbles as in q4_rows) or
// q8 with one scale a block (1); mn NULL: no offsets. pq N * K / 2 (q4) or N * K bytes, zeroed; pd
// and pm N * K / 32 floats.
void xinfer_panels(const uint8_t *qs, const float *d, const float *mn, int kind, int N, int K, uint8_t *pq, float *pd,
                   float *pm) {
    const int nb = K / 32;
    for (int n = 0; n < N; n++)
        for (int b = 0; b < nb; b++) {
            const size_t blk = (size_t)(n / 16) * nb + b, i = (size_t)n * nb + b;
            const int c = n % 16;
            pd[blk * 16 + c] = d[i], pm[blk * 16 + c] = mn ? mn[i] : 0.f;
            for (int k = 0; k < 32; k++) {
                const int lane = (c % 8) * 2 + k % 2;  // within its half
                if (kind == 0) {
                    const uint8_t *src = qs + i * 16;  // weights j and 16 + j in byte j
                    const uint8_t v = k < 16 ? src[k] & 0x0F : src[k - 16] >> 4;
                    uint8_t *dst = pq + (blk * 8 + k / 4) * 32 + (c < 8 ? 0 : 16) + lane;
                    *dst = k / 2 % 2 ? (uint8_t)((*dst & 0x0F) | (v << 4)) : (uint8_t)((*dst & 0xF0) | v);
                } else {
                    pq[(blk * 16 + k / 2) * 32 + (c < 8 ? 0 : 16) + lane] = qs[i * 32 + k];
                }
            }
        }
}

void xinfer_q8_mm(const int8_t *qs, const float *d, const float *mn, int gs, const float *x, float *y, int M, int N,
                  int K, int prec, const uint8_t *pq, const float *pd, const float *pm, const int16_t *pi) {
    const xq_linear w = {qs, d, mn, NULL, 1, N, K, gs, prec, pq, pd, pm, pi};
#pragma omp parallel
    mm_team(&w, x, y, M, NULL, NULL);
}

// Plain bfloat16 weights [N, K] (N a multiple of 16, K even) as the panels panel_dot_bf16 reads: per 16
// output columns, per pair of inputs p, 32 values, column c's inputs 2p and 2p + 1 at lanes 2c, 2c + 1.
void xinfer_bf16_pack(const uint16_t *w, int N, int K, uint16_t *out) {
    const int kp = K / 2;
#pragma omp parallel for schedule(static)
    for (int g = 0; g < N / 16; g++)
        for (int c = 0; c < 16; c++) {
            const uint32_t *src = (const uint32_t *)(w + (size_t)(16 * g + c) * K);
            uint32_t *dst = (uint32_t *)out + (size_t)g * kp * 16 + c;
            for (int p = 0; p < kp; p++) dst[(size_t)p * 16] = src[p];
        }
}

// y [M, N] = x [M, K] w^T (+ bias) on panels of plain bfloat16 weights (xinfer_bf16_pack): the inputs
// rounded to bfloat16, float32 sums, every batch size. (ops/qgemm.py Bf16Weight takes it only where
// xinfer_has_bf16.)
void xinfer_bf16_mm(const uint16_t *pw, const float *bias, const float *x, float *y, int M, int N, int K) {
#if HAS_BF16
    const xq_linear w = {NULL, NULL, NULL, bias, 2, N, K, 1, PREC_BF16, (const uint8_t *)pw, NULL, NULL, NULL, NULL};
    // rows in chunks whose rounded copy (2 K bytes a row) stays in L2 while every panel passes over it:
    // a 2,048-row prefill's whole copy came from memory again for each panel
    int chunk = (256 * 1024 / K) / PANEL_ROWS * PANEL_ROWS;
    chunk = chunk < PANEL_ROWS ? PANEL_ROWS : chunk;
#pragma omp parallel
    for (int m0 = 0; m0 < M; m0 += chunk)
        mm_team(&w, x + (size_t)m0 * K, y + (size_t)m0 * N, M - m0 < chunk ? M - m0 : chunk, NULL, NULL);
#else
    (void)pw; (void)bias; (void)x; (void)y; (void)M; (void)N; (void)K;
#endif
}

// A KV cache as attention reads it: [blocks, bs, Hkv, D] values of one kind (ops/kv_quant.py) and,
// for fp8, a float32 scale per token and head ([blocks, bs, Hkv]).
// The few vector operations decode attention needs, at the build's width (VW floats).
#if defined(__AVX512F__)
#define VW 16
typedef __m512 vf;
#define v_load _mm512_loadu_ps
#define v_store _mm512_storeu_ps
#define v_set1 _mm512_set1_ps
#define v_fma _mm512_fmadd_ps
#define v_mul _mm512_mul_ps
#define v_sub _mm512_sub_ps
#define v_add _mm512_add_ps
#define v_max _mm512_max_ps
#define v_min _mm512_min_ps
#define v_zero _mm512_setzero_ps
#define v_div _mm512_div_ps
static inline vf v_neg_abs(vf x) { return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN))); }
static inline vf v_if_neg(vf c, vf a, vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, v_zero(), _CMP_LT_OQ), b, a); }
static inline float v_hmax(vf v) { return _mm512_reduce_max_ps(v); }
// lanes c and up replaced by `fill`
static inline vf v_first(vf v, int c, float fill) {
    return _mm512_mask_blend_ps((__mmask16)((1u << c) - 1), _mm512_set1_ps(fill), v);
}
static inline vf v_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }
// Lane j: the sum of a[j]'s lanes (a transpose-and-add tree: 45 operations for 16 sums).
static inline vf v_sums(const vf *a) {
    vf w[8], x[4];
    for (int j = 0; j < 8; j++)
        w[j] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_ps(a[2 * j], a[2 * j + 1]));
    for (int j = 0; j < 4; j++)
        x[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const vf y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const vf y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}
#else
#define VW 8
typedef __m256 vf;
#define v_load _mm256_loadu_ps
#define v_store _mm256_storeu_ps
#define v_set1 _mm256_set1_ps
#define v_fma _mm256_fmadd_ps
#define v_mul _mm256_mul_ps
#define v_sub _mm256_sub_ps
#define v_add _mm256_add_ps
#define v_max _mm256_max_ps
#define v_min _mm256_min_ps
#define v_zero _mm256_setzero_ps
#define v_div _mm256_div_ps
static inline vf v_neg_abs(vf x) { return _mm256_or_ps(x, _mm256_set1_ps(-0.f)); }
static inline vf v_if_neg(vf c, vf a, vf b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(c, v_zero(), _CMP_LT_OQ)); }
static inline float v_hmax(vf v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf v_first(vf v, int c, float fill) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(keep));
}
static inline vf v_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf v_pow2(vf p, vf n) {  // n integral in [-127, 0]: added to p's exponent
    return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
static inline vf v_sums(const vf *a) {  // lane j: the sum of a[j]'s lanes
    const vf ab = _mm256_hadd_ps(a[0], a[1]), cd = _mm256_hadd_ps(a[2], a[3]);
    const vf ef = _mm256_hadd_ps(a[4], a[5]), gh = _mm256_hadd_ps(a[6], a[7]);
    const vf x = _mm256_hadd_ps(ab, cd), y = _mm256_hadd_ps(ef, gh);
    return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
}
#endif

// exp(x) for x <= 0 (Cephes' expf polynomial, about 1 ulp); below -87.3 it is not 0 but about 1e-38,
// which the callers mask where it matters.
static inline vf v_exp(vf x) {
    x = v_max(v_min(x, v_zero()), v_set1(-87.3f));
    const vf n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
    vf r = v_fma(n, v_set1(-0.693359375f), x);  // x - n ln 2, ln 2 in two parts
    r = v_fma(n, v_set1(2.12194440e-4f), r);
    vf p = v_set1(1.9875691500e-4f);
    p = v_fma(p, r, v_set1(1.3981999507e-3f));
    p = v_fma(p, r, v_set1(8.3334519073e-3f));
    p = v_fma(p, r, v_set1(4.1665795894e-2f));
    p = v_fma(p, r, v_set1(1.6666665459e-1f));
    p = v_fma(p, r, v_set1(5.0000001201e-1f));
    p = v_add(v_fma(p, v_mul(r, r), r), v_set1(1.f));
    return v_pow2(p, n);
}

// exp(x), and 0 below -87 (-inf included) where v_exp would give ~1e-38: a weight that must be none.
static inline vf v_exp0(vf x) {
#if defined(__AVX512F__)
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, v_set1(-87.f), _CMP_GT_OQ), v_exp(x));
#else
    return _mm256_and_ps(v_exp(x), _mm256_cmp_ps(x, v_set1(-87.f), _CMP_GT_OQ));
#endif
}

// out = silu(g) * u: g sigmoid(g), the exponential taken of -|g| only (v_exp's domain, and no overflow)
static void silu_mul(const float *g, const float *u, float *out, int n) {
    int i = 0;
    for (; i + VW <= n; i += VW) {
        const vf x = v_load(g + i), t = v_exp(v_neg_abs(x));
        const vf sig = v_div(v_if_neg(x, t, v_set1(1.f)), v_add(v_set1(1.f), t));
        v_store(out + i, v_mul(v_mul(x, sig), v_load(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.f + expf(-g[i])) * u[i];
}

// exp((l - mx) / t), and 0 below e^-87 (v_exp0's scalar twin).
static inline float weight0(float l, float mx, float t) {
    const float x = (l - mx) / t;
    return x > -87.f ? expf(x) : 0.f;
}

// Row b of logits [B, V] (rows ld apart) drawn at temperature temp[b] by its inverse CDF, as
// ops/sampling.py draw does from the softmax: the first token whose running sum of exp((l - max) / t)
// passes u[b] times the total (weights below e^-87 are none: -inf, banned, is never drawn); a sum
// that falls short by rounding takes the last token of weight.
// One pass for the max, one for the total, and on average half a pass for the draw.
void xinfer_sample(const float *logits, int64_t ld, int B, int V, const float *temp, const float *u, int64_t *out) {
#pragma omp parallel for schedule(dynamic, 1) if (B > 1)
    for (int b = 0; b < B; b++) {
        const float *l = logits + (size_t)b * ld;
        const float t = temp[b] > 1e-5f ? temp[b] : 1e-5f;  // what sampling.py clamps it to
        vf m = v_set1(-INFINITY);
        int i = 0;
        for (; i + VW <= V; i += VW) m = v_max(m, v_load(l + i));
        float mx = v_hmax(m);
        for (; i < V; i++) mx = fmaxf(mx, l[i]);
        const vf mv = v_set1(mx), inv = v_set1(1.f / t);
        vf s = v_zero();
        for (i = 0; i + VW <= V; i += VW) s = v_add(s, v_exp0(v_mul(v_sub(v_load(l + i), mv), inv)));
        float total = hsum(s);
        for (; i < V; i++) total += weight0(l[i], mx, t);
        const float target = u[b] * total;
        float run = 0.f;
        int64_t pick = -1;
        for (i = 0; pick < 0 && i + VW <= V; i += VW) {
            float e[VW];
            v_store(e, v_exp0(v_mul(v_sub(v_load(l + i), mv), inv)));
            float c = 0.f;
            for (int j = 0; j < VW; j++) c += e[j];
            if (run + c <= target) {
                run += c;
                continue;
            }
            for (int j = 0; j < VW; j++)
                if ((run += e[j]) > target) {
                    pick = i + j;
                    break;
                }
            if (pick < 0) pick = i + VW - 1;  // the chunk's sum passed, its terms one by one did not
        }
        for (; pick < 0 && i < V; i++)
            if ((run += weight0(l[i], mx, t)) > target) pick = i;
        if (pick < 0)  // short by rounding: the last token with weight
            for (pick = V - 1; pick > 0 && weight0(l[pick], mx, t) == 0.f; pick--) {}
        out[b] = pick;
    }
}

enum { KV_F32, KV_E4M3, KV_E5M2, KV_BF16, KV_F16, KV_TURBO };
typedef struct {
    void *data;
    float *scale;          // fp8: float32 per row; turbo: the float16 lengths
    int kind;
    int bits;              // turbo: bits a value (3, 4 or 8), packed 8 values to `bits` bytes
    const float *levels;   // turbo: the codebook, 2^bits floats
    const float *mids;     // turbo writes: the 2^bits - 1 midpoints between levels
    const float *rot;      // turbo writes: the rotation R [D, D]
    const float *shift;    // turbo key writes: the calibrated mean key [Hkv, D], or NULL
    int warm;              // 1: its lines were fetched during the last matmul (kv_pf), attention need not
} xq_kv;

static int kv_elem_bytes(int kind) {
    return kind == KV_F32 ? 4 : kind == KV_BF16 || kind == KV_F16 ? 2 : kind == KV_E4M3 || kind == KV_E5M2 ? 1 : 0;
}

// The bytes of K and V that B sequences' blocks hold in one layer's caches.
static size_t kv_bytes(const int32_t *lens, int B, int bs, int Hkv, int D, int kind) {
    size_t blocks = 0;
    for (int b = 0; b < B; b++) blocks += (size_t)(lens[b] + bs - 1) / bs;
    return blocks * 2 * bs * Hkv * D * kv_elem_bytes(kind);
}


// y = R x (transpose 0) or R^T x (1) for one head vector: a turbo cache's frame and back.
static void rotate(const float *R, const float *x, float *y, int D, int transpose) {
    if (!transpose) {
        for (int j = 0; j < D; j++) {
            float acc = 0.f;
            for (int i = 0; i < D; i++) acc += R[(size_t)j * D + i] * x[i];
            y[j] = acc;
        }
        return;
    }
    for (int i = 0; i < D; i++) y[i] = 0.f;
    for (int j = 0; j < D; j++)
        for (int i = 0; i < D; i++) y[i] += R[(size_t)j * D + i] * x[j];
}

// H head vectors x [H, D] rotated in place.
static void rotate_heads(const float *R, float *x, int H, int D, int transpose) {
    float y[D];
    for (int h = 0; h < H; h++) {
        rotate(R, x + (size_t)h * D, y, D, transpose);
        memcpy(x + (size_t)h * D, y, sizeof(float) * D);
    }
}

// One head vector into turbo row r, as ops/turbo_quant.py quantize() writes it: y = R (x - shift),
// each coordinate of y / |y| coded by the nearest level (the count of midpoints below it, as
// torch.bucketize), and the length n = |y| (u . c) / (c . c) in float16. The sums run in another
// order than torch's matmul, so a coordinate within rounding of a midpoint may take the other level.
static void turbo_write(const xq_kv *c, size_t r, const float *x, const float *shift, int D) {
    float xs[D], y[D];
    for (int i = 0; i < D; i++) xs[i] = shift ? x[i] - shift[i] : x[i];
    rotate(c->rot, xs, y, D, 0);
    float ss = 0.f;
    for (int j = 0; j < D; j++) ss += y[j] * y[j];
    const float len = sqrtf(ss), div = len > 1e-30f ? len : 1e-30f;
    const int nl = 1 << c->bits;
    uint8_t *p = (uint8_t *)c->data + r * (size_t)(D * c->bits / 8);
    float uc = 0.f, cc = 0.f;
    uint32_t word = 0;
    for (int j = 0; j < D; j++) {
        const float u = y[j] / div;
        int idx = 0;  // how many midpoints lie below u: a binary search (256 levels at 8 bits)
        for (int step = nl / 2; step > 0; step /= 2)
            if (c->mids[idx + step - 1] < u) idx += step;
        uc += u * c->levels[idx], cc += c->levels[idx] * c->levels[idx];
        if (c->bits == 8) {
            p[j] = (uint8_t)idx;
            continue;
        }
        word |= (uint32_t)idx << (c->bits * (j % 8));
        if (j % 8 == 7) {
            memcpy(p, &word, (size_t)c->bits);
            p += c->bits, word = 0;
        }
    }
    const float n = len * uc / (cc > 1e-30f ? cc : 1e-30f);
    ((uint16_t *)c->scale)[r] = _cvtss_sh(fminf(fmaxf(n, -65504.f), 65504.f), 0);
}

// turbo8's 256 levels for D bytes. AVX-512: eight 32-entry table lookups (permutex2var) of 16 bytes at
// a time, then the byte's top three bits pick one; AVX2: one at a time, as scalar loads beat its
// vector gathers (measured on Zen 4).
#if defined(__AVX512F__)
static void lookup_bytes(const uint8_t *p, const float *levels, float *out, int D) {
    for (int i = 0; i < D; i += 16) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + i)));
        __m512 r[8];
        for (int j = 0; j < 8; j++)
            r[j] = _mm512_permutex2var_ps(_mm512_loadu_ps(levels + 32 * j), idx, _mm512_loadu_ps(levels + 32 * j + 16));
        for (int bit = 5, n = 8; bit < 8; bit++, n /= 2) {
            const __mmask16 hi = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(1 << bit));
            for (int j = 0; j < n / 2; j++) r[j] = _mm512_mask_blend_ps(hi, r[2 * j], r[2 * j + 1]);
        }
        _mm512_storeu_ps(out + i, r[0]);
    }
}
#else
__attribute__((optimize("no-tree-vectorize"))) static void lookup_bytes(const uint8_t *p, const float *levels,
                                                                        float *out, int D) {
    for (int i = 0; i < D; i++) out[i] = levels[p[i]];
}
#endif

// A turbo row (ops/turbo_quant.py) as its codebook levels, without the length: eight values are a
// little-endian word of 8 * bits bits, value j in bits j * bits and up (read out by one shift a lane).
static inline void turbo_row(const uint8_t *p, int bits, const float *levels, float *out, int D) {
    if (bits == 8) {
        lookup_bytes(p, levels, out, D);
        return;
    }
    const __m256i shift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
    const __m256 lo = _mm256_loadu_ps(levels), hi = bits == 4 ? _mm256_loadu_ps(levels + 8) : lo;
    for (int i = 0; i < D; i += 8, p += bits) {
        uint32_t w;
        if (bits == 4)
            memcpy(&w, p, 4);
        else  // three bytes (a four-byte read could pass the end of the cache)
            w = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16;
        const __m256i idx = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)w), shift), mask);
        __m256 v = _mm256_permutevar8x32_ps(lo, idx);
        if (bits == 4)  // levels 8-15 where bit 3 is set (moved to the sign bit blendv reads)
            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(hi, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        _mm256_storeu_ps(out + i, v);
    }
}

// e5m2 is the top byte of a float16; e4m3's bits, moved into float16's, read 2^8 too small (for
// normals and subnormals alike), which the row's scale makes up (kv_scale). F16C converts 8 at a time.
static inline uint16_t fp8_half(uint8_t b, int e4m3) {
    return e4m3 ? (uint16_t)(((b & 0x7F) << 7) | ((b & 0x80) << 8)) : (uint16_t)(b << 8);
}

// bfloat16 <-> float32, VW values: widening is exact; narrowing rounds to nearest-even as torch does.
#if VW == 16
static inline vf bf16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void bf16_store(uint16_t *p, vf x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(r));
}
#else
static inline vf bf16_load(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline void bf16_store(uint16_t *p, vf x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
}
#endif

// One bfloat16 value widened (exact), one float32 rounded to nearest-even (as torch casts; finite x).
static inline float bf16_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f32_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Row r (= slot * Hkv + head) as D float32 values, without its scale: the cache itself (float32) or buf.
static inline const float *kv_row(const xq_kv *c, size_t r, int D, float *buf) {
    int i = 0;
    if (c->kind == KV_F32) return (const float *)c->data + r * D;
    if (c->kind == KV_TURBO) {
        turbo_row((const uint8_t *)c->data + r * (size_t)(D * c->bits / 8), c->bits, c->levels, buf, D);
        return buf;
    }
    if (c->kind == KV_E4M3 || c->kind == KV_E5M2) {
        const uint8_t *p = (const uint8_t *)c->data + r * D;
        const int e4m3 = c->kind == KV_E4M3;
        const __m128i lo7 = _mm_set1_epi16(0x7F), sign = _mm_set1_epi16(0x80);
        for (; i + 8 <= D; i += 8) {
            __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(p + i)));
            w = e4m3 ? _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, lo7), 7),
                                    _mm_slli_epi16(_mm_and_si128(w, sign), 8))
                     : _mm_slli_epi16(w, 8);
            _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(w));
        }
        for (; i < D; i++) buf[i] = _cvtsh_ss(fp8_half(p[i], e4m3));
    } else if (c->kind == KV_F16) {
        const uint16_t *p = (const uint16_t *)c->data + r * D;
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
        for (; i < D; i++) buf[i] = _cvtsh_ss(p[i]);
    } else {  // bfloat16: the top half of a float32
        const uint16_t *p = (const uint16_t *)c->data + r * D;
        for (; i + 8 <= D; i += 8)
            _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + i))), 16)));
        for (; i < D; i++) buf[i] = bf16_f32(p[i]);
    }
    return buf;
}

static inline float kv_scale(const xq_kv *c, size_t r) {
    if (c->kind == KV_TURBO) return _cvtsh_ss(((const uint16_t *)c->scale)[r]);
    return c->kind == KV_E4M3 ? c->scale[r] * 256.f : c->kind == KV_E5M2 ? c->scale[r] : 1.f;
}

// x (within fp8's finite range) rounded to nearest-even on fp8's grid, as torch converts: adding and
// taking away 1.5 * 2^23 times the grid step at x's exponent (fixed below the smallest normal) rounds
// in float32 (no contraction: -ffp-contract=off).
static inline float fp8_round(float x, int e4m3) {
    const int emin = e4m3 ? -6 : -14, mbits = e4m3 ? 3 : 2, e = ilogbf(x);
    const float big = ldexpf(1.5f, (e < emin ? emin : e) - mbits + 23);
    return copysignf((x + big) - big, x);  // what rounds to zero keeps its sign, as torch's does
}

// One token's Hkv head vectors x (D floats each) into cache row r0 = slot * Hkv onwards, as
// ops/kv_quant.py writes them: fp8 with a scale per head (max |x| / the format's max), else a cast.
static void kv_write(const xq_kv *c, size_t r0, const float *x, int Hkv, int D) {
    if (c->kind == KV_F32) {
        memcpy((float *)c->data + r0 * D, x, sizeof(float) * (size_t)Hkv * D);
        return;
    }
    if (c->kind == KV_TURBO) {
        for (int h = 0; h < Hkv; h++)
            turbo_write(c, r0 + h, x + (size_t)h * D, c->shift ? c->shift + (size_t)h * D : NULL, D);
        return;
    }
    for (int h = 0; h < Hkv; h++) {
        const float *xh = x + (size_t)h * D;
        const size_t r = r0 + h;
        if (c->kind == KV_E4M3 || c->kind == KV_E5M2) {
            const int e4m3 = c->kind == KV_E4M3;
            const float fmax = e4m3 ? 448.f : 57344.f;
            float amax = 0.f;
            for (int i = 0; i < D; i++) amax = fmaxf(amax, fabsf(xh[i]));
            const float sc = amax > 0.f ? amax / fmax : 1.f;
            c->scale[r] = sc;
            uint8_t *p = (uint8_t *)c->data + r * D;
            for (int i = 0; i < D; i++) {
                // on the grid, x / 2^8 (e4m3) is exact in float16, whose bits give the byte (kv_row)
                const float v = fp8_round(fminf(fmaxf(xh[i] / sc, -fmax), fmax), e4m3);
                const uint16_t hb = _cvtss_sh(e4m3 ? v * 0x1p-8f : v, 0);
                p[i] = e4m3 ? (uint8_t)(((hb >> 7) & 0x7F) | ((hb >> 8) & 0x80)) : (uint8_t)(hb >> 8);
            }
        } else if (c->kind == KV_F16) {
            uint16_t *p = (uint16_t *)c->data + r * D;
            for (int i = 0; i < D; i++) p[i] = _cvtss_sh(xh[i], 0);
        } else {  // bfloat16, rounded to nearest-even as torch casts
            uint16_t *p = (uint16_t *)c->data + r * D;
            int i = 0;
            for (; i + VW <= D; i += VW) bf16_store(p + i, v_load(xh + i));
            for (; i < D; i++) p[i] = f32_bf16(xh[i]);
        }
    }
}

// T tokens' K or V x [T, Hkv, D] (rows x_ld floats apart: a view into the QKV projection's output)
// into the cache at slots [T], as the one-call decode step writes them.
// turbo: its bits, levels, midpoints, rotation and key shift (or NULL); else 0 and NULLs.
void xinfer_kv_store(void *data, float *scale, int kind, const int64_t *slots, const float *x, int64_t x_ld, int T,
                     int Hkv, int D, int bits, const float *levels, const float *mids, const float *rot,
                     const float *shift) {
    const xq_kv c = {data, scale, kind, bits, levels, mids, rot, shift};
#pragma omp parallel for schedule(static) if (T >= 64)
    for (int t = 0; t < T; t++)
        if (slots[t] >= 0) kv_write(&c, (size_t)slots[t] * Hkv, x + (size_t)t * x_ld, Hkv, D);  // -1: a padding row
}

// Rows of tokens t0 .. t0 + cnt - 1 of KV head h as D floats each, row j at the pointer returned
// plus j * *stride: the cache's own rows when it is float32 and the chunk's VW rows lie in one block
// (the rows past cnt are read, never used), else converted or copied into buf (VW * D floats, the
// rows past cnt zero). scale[j]: row j's scale, 0 past cnt. One base pointer, not VW, keeps the
// loops over the rows within the registers.
static inline const float *chunk_rows(const xq_kv *c, const int32_t *tab, int t0, int cnt, int bs, int Hkv, int h,
                                      int D, float *buf, size_t *stride, float *scale) {
    int blk = t0 / bs, off = t0 % bs;  // one division a chunk, not one a row
    if (c->kind == KV_F32 && off + VW <= bs) {
        for (int j = 0; j < VW; j++) scale[j] = j < cnt ? 1.f : 0.f;
        *stride = (size_t)Hkv * D;
        return (const float *)c->data + (((size_t)tab[blk] * bs + off) * Hkv + h) * D;
    }
    for (int j = 0; j < VW; j++) {
        float *dst = buf + (size_t)j * D;
        if (j >= cnt) {
            memset(dst, 0, sizeof(float) * (size_t)D), scale[j] = 0.f;
            continue;
        }
        const size_t r = ((size_t)tab[blk] * bs + off) * Hkv + h;
        const float *src = kv_row(c, r, D, dst);
        if (src != dst) memcpy(dst, src, sizeof(float) * (size_t)D);
        scale[j] = kv_scale(c, r);
        if (++off == bs) off = 0, blk++;
    }
    *stride = (size_t)D;
    return buf;
}

// Positions scored before their softmax update and P.V (attend_span)
#define SPAN (8 * VW)
#if VW == 16
#define PV_G 4  // query heads a P.V pass accumulates together (PV_G * 4 accumulators)
#else
#define PV_G 2
#endif

// o[g] (D floats each, `ld` apart) += sum over the chunk's cnt tokens of p[g][j] * scale[j] * V row
// j, for gn (<= PV_G) query heads and the in (<= 4) VW-wide slices from i0: every V slice is loaded
// once for the gn heads, and the gn * in sums are independent chains.
static inline __attribute__((always_inline)) void pv_block(const float *vr, size_t vstride, const float *vs,
                                                          const float *p, int pstride, int cnt, float *o, int ld,
                                                          int i0, int gn, int in) {
    vf acc[PV_G][4];
    for (int g = 0; g < gn; g++)
        for (int i = 0; i < in; i++) acc[g][i] = v_zero();
    for (int j = 0; j < cnt; j++, vr += vstride) {
        vf v[4];
        for (int i = 0; i < in; i++) v[i] = v_load(vr + i0 + i * VW);
        for (int g = 0; g < gn; g++) {
            const vf w = v_set1(p[(size_t)g * pstride + j] * vs[j]);
            for (int i = 0; i < in; i++) acc[g][i] = v_fma(w, v[i], acc[g][i]);
        }
    }
    for (int g = 0; g < gn; g++)
        for (int i = 0; i < in; i++) {
            float *og = o + (size_t)g * ld + i0 + i * VW;
            v_store(og, v_add(v_load(og), acc[g][i]));
        }
}

#define PV_IN(GN)                                                                                    \
    switch (in) {                                                                                    \
    case 4: pv_block(vr, vstride, vs, p, pstride, cnt, o, ld, i0, GN, 4); break;                             \
    case 2: pv_block(vr, vstride, vs, p, pstride, cnt, o, ld, i0, GN, 2); break;                             \
    default: for (int i = 0; i < in; i++) pv_block(vr, vstride, vs, p, pstride, cnt, o, ld, i0 + i * VW, GN, 1); \
    }

static void pv_chunk(const float *vr, size_t vstride, const float *vs, const float *p, int pstride, int cnt, float *o,
                     int ld, int G, int D) {
    for (int g0 = 0; g0 < G; g0 += PV_G, p += (size_t)PV_G * pstride, o += (size_t)PV_G * ld)
        for (int i0 = 0; i0 < D; i0 += 4 * VW) {
            const int gn = G - g0 < PV_G ? G - g0 : PV_G, in = (D - i0) / VW < 4 ? (D - i0) / VW : 4;
            switch (gn) {
            case 1: PV_IN(1) break;
#if PV_G == 4
            case 3: PV_IN(3) break;
            case 4: PV_IN(4) break;
#endif
            default: PV_IN(2)
            }
        }
}
#undef PV_IN

// Lane j: the dot product of query qg with row j of the chunk (at k + j * stride), nd vectors long:
// nd a constant where it is 4 or 8 (head sizes 64 and 128 of AVX-512), so the sums stay in registers.
static inline __attribute__((always_inline)) vf qk_chunk(const float *qg, const float *k, size_t stride, int nd) {
    vf acc[VW];
    for (int j = 0; j < VW; j++, k += stride) {
        acc[j] = v_mul(v_load(qg), v_load(k));
        for (int i = 1; i < nd; i++) acc[j] = v_fma(v_load(qg + i * VW), v_load(k + i * VW), acc[j]);
    }
    return v_sums(acc);
}

// One online-softmax update per query head over a span's n scores (Hkv * G heads, SPAN apart in sc,
// head h * G + g): its running max and sum of exponentials (mx[h][g], sum[h][g]), its output o[h] + g
// * D rescaled, and its scores replaced by their exponentials (0 past n). softcap > 0: scores =
// softcap * tanh(scores / softcap) first.
static void span_softmax(float *sc, int n, int Hkv, int G, int D, float softcap, float *const *o, float *const *mx,
                         float *const *sum) {
    const int nc = (n + VW - 1) / VW;
    float rs[VW];
    for (int h = 0; h < Hkv; h++)
        for (int g = 0; g < G; g++) {
            float *s = sc + (size_t)(h * G + g) * SPAN;
            if (softcap > 0.f)
                for (int j = 0; j < n; j++) s[j] = softcap * tanhf(s[j] / softcap);
            for (int j = n; j < nc * VW; j++) s[j] = -INFINITY;
            vf m = v_load(s);
            for (int c = 1; c < nc; c++) m = v_max(m, v_load(s + c * VW));
            const float mnew = fmaxf(mx[h][g], v_hmax(m)), alpha = expf(mx[h][g] - mnew);  // 0 at the first span
            const vf mv = v_set1(mnew);
            vf tot = v_zero();
            for (int c = 0; c < nc; c++) {
                const vf e = v_first(v_exp(v_sub(v_load(s + c * VW), mv)), c == nc - 1 ? n - c * VW : VW, 0.f);
                v_store(s + c * VW, e);
                tot = v_add(tot, e);
            }
            v_store(rs, tot);
            float esum = 0.f;
            for (int j = 0; j < VW; j++) esum += rs[j];
            sum[h][g] = sum[h][g] * alpha + esum, mx[h][g] = mnew;
            if (alpha != 1.f) {
                float *og = o[h] + (size_t)g * D;
                const vf a = v_set1(alpha);
                for (int i = 0; i < D; i += VW) v_store(og + i, v_mul(v_load(og + i), a));
            }
        }
}

// The rows a span reads, in the order it reads them (its keys, its values, then the next span's
// first keys), fetched toward L2 a few at a time as it computes, ~PF_AHEAD bytes ahead of its reads.
// Fetches issued in bursts (a chunk's or a span's rows at once, as before) fill the core's miss
// queue and stall its own loads, so reading and computing did not overlap (bench/NOTES-cpu.md, ninth
// session).
#define PF_AHEAD (24 << 10)  // 64 rows of a bfloat16 cache, 32 of float32 (measured best of 16-128)
typedef struct {
    const char *k, *v;
    const int32_t *tab, *ntab;    // this span's block table, the next span's (or NULL)
    int c0, n, a0, nn, bs, row;   // positions c0 .. c0 + n - 1, then a0 .. a0 + nn - 1; row: bytes a position
    int ahead, pos;               // rows fetched ahead of the reads; rows issued so far
} row_feed;

static inline void feed_to(row_feed *f, int upto) {
    const int total = 2 * f->n + (f->nn < f->ahead ? f->nn : f->ahead);
    upto += f->ahead;
    if (upto > total) upto = total;
    for (; f->pos < upto; f->pos++) {
        const int i = f->pos, v = i >= f->n && i < 2 * f->n;
        const int t = i < f->n ? f->c0 + i : v ? f->c0 + i - f->n : f->a0 + i - 2 * f->n;
        const int32_t *tab = i < 2 * f->n ? f->tab : f->ntab;
        const char *p = (v ? f->v : f->k) + ((size_t)tab[t / f->bs] * f->bs + t % f->bs) * f->row;
        for (int b = 0; b < f->row; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
    }
}

// Decode attention straight from the paged KV cache (no gather): one query row per sequence.
// Every KV head's G query heads qh over the n <= SPAN tokens c0 .. c0 + n - 1 (tab: the sequence's
// block table). All the span's scores first (each chunk of VW tokens out of one v_sums, its K rows
// read once for the G heads), then one online-softmax update per query head over the span (vector
// max and exp), then P.V with each V row read once for the G heads. softcap > 0: scores = softcap
// * tanh(scores / softcap). o[h] [G, D] stays unnormalized, with each head's running max and sum of
// exponentials in mx[h] and sum[h]. A chunk's tokens hold all their heads side by side ([bs, Hkv, D]
// blocks), so the heads are inner: each block is read from memory in one sweep.
static void attend_span(const float *q, const xq_kv *kc, const xq_kv *vc, const int32_t *tab, int c0, int n, int G,
                        int Hkv, int D, int bs, float scale, float softcap, float *const *o, float *const *mx,
                        float *const *sum, row_feed *f) {
    const int nc = (n + VW - 1) / VW;
    float sc[Hkv * G][SPAN], buf[VW * D], rs[VW];
    size_t stride;
    for (int c = 0; c < nc; c++) {
        const int cnt = n - c * VW < VW ? n - c * VW : VW;
        for (int h = 0; h < Hkv; h++) {
            feed_to(f, c * VW + VW * (h + 1) / Hkv);
            const float *kr = chunk_rows(kc, tab, c0 + c * VW, cnt, bs, Hkv, h, D, buf, &stride, rs);
            const vf ks = v_mul(v_load(rs), v_set1(scale));
            for (int g = 0; g < G; g++) {
                const float *qg = q + ((size_t)h * G + g) * D;
                const vf sums = D == 4 * VW ? qk_chunk(qg, kr, stride, 4) : D == 8 * VW ? qk_chunk(qg, kr, stride, 8)
                                                                                        : qk_chunk(qg, kr, stride, D / VW);
                v_store(sc[h * G + g] + c * VW, v_mul(sums, ks));
            }
        }
    }
    span_softmax(&sc[0][0], n, Hkv, G, D, softcap, o, mx, sum);
    for (int c = 0; c < nc; c++) {
        const int cnt = n - c * VW < VW ? n - c * VW : VW;
        for (int h = 0; h < Hkv; h++) {
            feed_to(f, n + c * VW + VW * (h + 1) / Hkv);
            const float *vr = chunk_rows(vc, tab, c0 + c * VW, cnt, bs, Hkv, h, D, buf, &stride, rs);
            pv_chunk(vr, stride, rs, sc[h * G] + c * VW, SPAN, cnt, o[h], D, G, D);
        }
    }
}

#if defined(__AVX512BF16__)
// A bfloat16 cache's decode attention on the dot-product units (vdpbf16ps), its rows read where
// they lie: no conversion into a buffer, which with the per-row work of float32 FMAs made the
// kernel compute-bound even from memory (bench/NOTES-cpu.md). The query and the probabilities are
// each split into bfloat16 hi + lo (lo = x - hi, rounded again): every product is exact in float32,
// so the scores and outputs keep float32's precision to ~2^-16 relative (one bfloat16 rounding of q
// or p would be 2^-9). Head sizes 64 and 128 (KD = D / 32 vectors a row, in registers).
static inline void split_bf16(const float *x, uint16_t *hi, uint16_t *lo, int n) {  // n a multiple of 16
    for (int i = 0; i < n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        const __m512 hv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_storeu_si256((__m256i *)(hi + i), h);
        _mm256_storeu_si256((__m256i *)(lo + i), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(v, hv)));
    }
}

// Where the span's rows start (head 0; K and V alike), VW a chunk: past n the last row again,
// whose probability is 0.
static inline void bf16_span_rows(const int32_t *tab, int c0, int n, int bs, int Hkv, int D, size_t *at) {
    int blk = c0 / bs, off = c0 % bs;
    const int nv = (n + VW - 1) / VW * VW;
    for (int j = 0; j < nv; j++) {
        at[j] = j < n ? ((size_t)tab[blk] * bs + off) * Hkv * D : at[n - 1];
        if (++off == bs) off = 0, blk++;
    }
}

// Lane j: q . row j (hi and lo parts, KD vectors of 32 each), over the chunk's VW rows at + hoff.
static inline __attribute__((always_inline)) vf qk_bf16(const __m512bh *qh, const __m512bh *ql,
                                                        const uint16_t *base, const size_t *at, int KD) {
    vf acc[VW];
    for (int j = 0; j < VW; j++) {
        const uint16_t *k = base + at[j];
        vf a = v_zero();
        for (int i = 0; i < KD; i++) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + 32 * i);
            a = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a, qh[i], kv), ql[i], kv);
        }
        acc[j] = a;
    }
    return v_sums(acc);
}

// o[g] += sum over the chunk's VW rows (at + hoff) of p[g][j] v[j], 64 values of d from i0, for GN query
// heads (probabilities ph / pl, SPAN apart). Rows j and j + 1 interleaved (unpacklo / hi_epi16) make
// pairs (v[j][d], v[j + 1][d]) that one vdpbf16ps multiplies by the broadcast pair (p[j], p[j + 1]);
// the unpacks leave d in the order 0-3, 8-11, .. (lo) and 4-7, 12-15, .. (hi), put back on the add into o.
static inline __attribute__((always_inline)) void pv_bf16(const uint16_t *base, const size_t *at, int i0,
                                                          const uint16_t *ph, const uint16_t *pl, float *o, int D,
                                                          int GN) {
    vf acc[4][4];
    for (int g = 0; g < GN; g++)
        for (int i = 0; i < 4; i++) acc[g][i] = v_zero();
    for (int j = 0; j < VW; j += 2) {
        const uint16_t *a = base + at[j] + i0, *b = base + at[j + 1] + i0;
        const __m512i a0 = _mm512_loadu_si512(a), a1 = _mm512_loadu_si512(a + 32);
        const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 32);
        const __m512bh u[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                               (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int g = 0; g < GN; g++) {
            uint32_t h2, l2;
            memcpy(&h2, ph + (size_t)g * SPAN + j, 4), memcpy(&l2, pl + (size_t)g * SPAN + j, 4);
            const __m512bh hp = (__m512bh)_mm512_set1_epi32((int)h2), lp = (__m512bh)_mm512_set1_epi32((int)l2);
            for (int i = 0; i < 4; i++) acc[g][i] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[g][i], hp, u[i]), lp, u[i]);
        }
    }
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < GN; g++) {
        float *og = o + (size_t)g * D + i0;
        for (int i = 0; i < 4; i += 2) {
            float *oi = og + 16 * i;
            v_store(oi, v_add(v_load(oi), _mm512_permutex2var_ps(acc[g][i], lo, acc[g][i + 1])));
            v_store(oi + 16, v_add(v_load(oi + 16), _mm512_permutex2var_ps(acc[g][i], hi, acc[g][i + 1])));
        }
    }
}

// attend_span for a bfloat16 cache: qh / ql the sequence's query heads [Hq, D] split in two.
static void attend_span_bf16(const uint16_t *qh, const uint16_t *ql, const xq_kv *kc, const xq_kv *vc,
                             const int32_t *tab, int c0, int n, int G, int Hkv, int D, int bs, float scale,
                             float softcap, float *const *o, float *const *mx, float *const *sum, row_feed *f) {
    const int nc = (n + VW - 1) / VW, KD = D / 32;
    float sc[Hkv * G][SPAN];
    uint16_t ph[Hkv * G][SPAN], pl[Hkv * G][SPAN];
    size_t at[SPAN];
    const uint16_t *kb = kc->data, *vb = vc->data;
    const vf sv = v_set1(scale);
    bf16_span_rows(tab, c0, n, bs, Hkv, D, at);
    const int calls = Hkv * G;  // scores: a chunk's calls, each issuing its share of the chunk's fetches
    for (int c = 0; c < nc; c++) {
        const size_t *ac = at + c * VW;
        for (int h = 0; h < Hkv; h++)
            for (int g = 0; g < G; g++) {
                const size_t qo = ((size_t)h * G + g) * D;
                feed_to(f, c * VW + VW * (h * G + g + 1) / calls);
                __m512bh qhv[4], qlv[4];
                for (int i = 0; i < KD; i++)
                    qhv[i] = (__m512bh)_mm512_loadu_si512(qh + qo + 32 * i), qlv[i] = (__m512bh)_mm512_loadu_si512(ql + qo + 32 * i);
                const vf s = KD == 2 ? qk_bf16(qhv, qlv, kb + (size_t)h * D, ac, 2) : qk_bf16(qhv, qlv, kb + (size_t)h * D, ac, 4);
                v_store(sc[h * G + g] + c * VW, v_mul(s, sv));
            }
    }
    span_softmax(&sc[0][0], n, Hkv, G, D, softcap, o, mx, sum);
    for (int r = 0; r < Hkv * G; r++) split_bf16(sc[r], ph[r], pl[r], nc * VW);
    const int pcalls = Hkv * ((G + 3) / 4) * (D / 64);
    for (int c = 0; c < nc; c++) {
        const size_t *ac = at + c * VW;
        int k = 0;
        for (int h = 0; h < Hkv; h++)
            for (int g0 = 0; g0 < G; g0 += 4)
                for (int i0 = 0; i0 < D; i0 += 64) {
                    feed_to(f, n + c * VW + VW * ++k / pcalls);
                    const int gn = G - g0 < 4 ? G - g0 : 4;
                    const uint16_t *hp = ph[h * G + g0] + c * VW, *lp = pl[h * G + g0] + c * VW, *vh = vb + (size_t)h * D;
                    float *og = o[h] + (size_t)g0 * D;
                    switch (gn) {
                    case 1: pv_bf16(vh, ac, i0, hp, lp, og, D, 1); break;
                    case 2: pv_bf16(vh, ac, i0, hp, lp, og, D, 2); break;
                    case 3: pv_bf16(vh, ac, i0, hp, lp, og, D, 3); break;
                    default: pv_bf16(vh, ac, i0, hp, lp, og, D, 4);
                    }
                }
    }
    feed_to(f, 2 * n);
}
#endif

// Every KV head of one sequence over its positions t0 .. t1 - 1, a span at a time. o[h], mx[h],
// sum[h]: where KV head h's G query heads keep their state. ntab (or NULL), nt0 .. nt1: what the
// thread reads next, whose first span the last one fetches toward L2.
static void attend_range(const float *q, const xq_kv *kc, const xq_kv *vc, const int32_t *tab, int t0, int t1,
                         int G, int Hkv, int D, int bs, float scale, float softcap, float *const *o,
                         float *const *mx, float *const *sum, const int32_t *ntab, int nt0, int nt1) {
    for (int h = 0; h < Hkv; h++) {
        for (int g = 0; g < G; g++) mx[h][g] = -INFINITY, sum[h][g] = 0.f;
        memset(o[h], 0, sizeof(float) * (size_t)G * D);
    }
#if defined(__AVX512BF16__)
    const int on_dp = kc->kind == KV_BF16 && (D == 64 || D == 128);  // attend_span_bf16
    uint16_t qh[on_dp ? Hkv * G * D : 1], ql[on_dp ? Hkv * G * D : 1];
    if (on_dp) split_bf16(q, qh, ql, Hkv * G * D);
#else
    const int on_dp = 0;
#endif
    // the row feed's bytes a position and rows ahead, the same for every span of the range
    const int row = kc->kind == KV_TURBO ? Hkv * D * kc->bits / 8 : Hkv * D * kv_elem_bytes(kc->kind);
    const int ahead = row && PF_AHEAD / row > 8 ? PF_AHEAD / row : 8;
    for (int c0 = t0; c0 < t1; c0 += SPAN) {
        const int n = t1 - c0 < SPAN ? t1 - c0 : SPAN;
        // the span read next (this range's or the next one's), whose first keys this one fetches
        const int32_t *nx = c0 + SPAN < t1 ? tab : ntab;
        const int a0 = c0 + SPAN < t1 ? c0 + SPAN : nt0, a1 = c0 + SPAN < t1 ? t1 : nt1;
        const int nn = nx && a1 > a0 ? (a1 - a0 < SPAN ? a1 - a0 : SPAN) : 0;
        row_feed f = {kc->data, vc->data, tab, nx, c0, n, a0, nn, bs, row, ahead, 0};
        if (kc->warm || !row) f.pos = 2 * n, f.nn = 0;  // all fetched during the matmul before
        else if (c0 > t0) f.pos = n < f.ahead ? n : f.ahead;  // the span before fetched them
#if defined(__AVX512BF16__)
        if (on_dp) {
            attend_span_bf16(qh, ql, kc, vc, tab, c0, n, G, Hkv, D, bs, scale, softcap, o, mx, sum, &f);
            continue;
        }
#endif
        attend_span(q, kc, vc, tab, c0, n, G, Hkv, D, bs, scale, softcap, o, mx, sum, &f);
    }
}

// How many position ranges each sequence is split into: one where the sequences alone keep every
// thread busy, else enough for about four items a thread (a long context with few sequences), each
// of at least ~64 positions. Every item reads its K/V once, for all its query heads.
static int attn_splits(int B, int max_len) {
    const int T = omp_get_max_threads(), cap = (max_len + 63) / 64;
    if (B >= 2 * T) return 1;
    const int s = (4 * T + B - 1) / B;
    return s < cap ? s : (cap > 1 ? cap : 1);
}

// Sequence b's position range s of S (attend_team).
static void item_range(const int32_t *lens, int window, int S, int it, int *t0, int *t1) {
    const int L = lens[it / S], s = it % S;
    const int start = (window > 0 && L > window) ? L - window : 0;
    const int per = ((L - start + S - 1) / S + VW - 1) / VW * VW;  // whole chunks but the last
    *t0 = start + s * per < L ? start + s * per : L, *t1 = *t0 + per < L ? *t0 + per : L;
}

// Item `it` (sequence it / S, range it % S); `next` the one its thread takes after it (or -1).
static void attend_item(const float *q, int64_t q_stride, const xq_kv *kc, const xq_kv *vc, const int32_t *tables,
                        int table_stride, const int32_t *lens, float *out, int Hq, int Hkv, int D, int bs,
                        float scale, int window, float softcap, int S, float *part, int it, int next) {
    const int G = Hq / Hkv, b = it / S, s = it % S;
    int t0, t1, n0 = 0, n1 = 0;
    item_range(lens, window, S, it, &t0, &t1);
    if (next >= 0) item_range(lens, window, S, next, &n0, &n1);
    float mxs[Hq], sums[Hq], *o[Hkv], *mx[Hkv], *sum[Hkv];
    for (int h = 0; h < Hkv; h++) {
        if (S == 1) {
            o[h] = out + ((size_t)b * Hq + (size_t)h * G) * D, mx[h] = mxs + h * G, sum[h] = sums + h * G;
        } else {
            float *p = part + (((size_t)b * Hkv + h) * S + s) * G * (D + 2);
            o[h] = p, mx[h] = p + (size_t)G * D, sum[h] = p + (size_t)G * D + G;
        }
    }
    attend_range(q + (size_t)b * q_stride, kc, vc, tables + (size_t)b * table_stride, t0, t1, G, Hkv, D, bs,
                 scale, softcap, o, mx, sum, next >= 0 ? tables + (size_t)(next / S) * table_stride : NULL, n0, n1);
    if (S == 1) {
        for (int j = 0; j < Hq; j++) {
            const vf inv = v_set1(sums[j] > 0.f ? 1.f / sums[j] : 0.f);
            float *oj = out + ((size_t)b * Hq + j) * D;
            for (int i = 0; i < D; i += VW) v_store(oj + i, v_mul(v_load(oj + i), inv));
        }
    }
}

// Every sequence's attention, shared out over the threads of the enclosing parallel region by
// (sequence, position range). q rows q_stride apart, out [B, Hq, D]; window > 0: only the
// last `window` positions. S ranges (attn_splits): part holds each (sequence, KV head, range)'s
// unnormalized output, max and sum (B * Hkv * S * G * (D + 2) floats), merged afterwards.
static void attend_team(const float *q, int64_t q_stride, const xq_kv *kc, const xq_kv *vc, const int32_t *tables,
                        int table_stride, const int32_t *lens, float *out, int B, int Hq, int Hkv, int D, int bs,
                        float scale, int window, float softcap, int S, float *part, int *counter) {
    const int G = Hq / Hkv;
#define ATTEND_ITEM(next) attend_item(q, q_stride, kc, vc, tables, table_stride, lens, out, Hq, Hkv, D, bs, scale, \
                                      window, softcap, S, part, it, next)
    if (B == 1) {  // in order: each thread reads the ranges whose lines it prefetched (kv_pf)
#pragma omp for schedule(static)
        for (int it = 0; it < S; it++) ATTEND_ITEM(-1);
    } else {  // thread t starts with item t (past 1 MB of K/V, kv_pf fetched its first span), then one
              // item at a time, each taken before the thread starts the one before it
        const int T = omp_get_num_threads();
#pragma omp single
        *counter = T;
        int it = omp_get_thread_num();
        while (it < B * S) {
            const int next = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
            ATTEND_ITEM(next < B * S ? next : -1);
            it = next;
        }
#pragma omp barrier
    }
#undef ATTEND_ITEM
    if (S == 1) return;
#pragma omp for schedule(static)
    for (int j = 0; j < B * Hq; j++) {  // query head g of KV head h of sequence b: its S ranges merged
        const int b = j / Hq, h = j % Hq / G, g = j % G;
        const float *p0 = part + ((size_t)b * Hkv + h) * S * G * (D + 2);
        float m = -INFINITY, total = 0.f, *o = out + (size_t)j * D;
        for (int s = 0; s < S; s++) m = fmaxf(m, p0[(size_t)s * G * (D + 2) + (size_t)G * D + g]);
        for (int i = 0; i < D; i++) o[i] = 0.f;
        for (int s = 0; s < S; s++) {
            const float *p = p0 + (size_t)s * G * (D + 2), ms = p[(size_t)G * D + g];
            if (ms == -INFINITY) continue;  // an empty range
            const float w = expf(ms - m);
            total += w * p[(size_t)G * D + G + g];
            for (int i = 0; i < D; i++) o[i] += w * p[(size_t)g * D + i];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int i = 0; i < D; i++) o[i] *= inv;
    }
}

static int max_len(const int32_t *lens, int B) {
    int m = 1;
    for (int b = 0; b < B; b++) m = lens[b] > m ? lens[b] : m;
    return m;
}

int xinfer_attn_width(void) { return VW; }  // head sizes the C attention takes: multiples of this

// q [B, Hq, D] (rows q_ld floats apart, heads packed), caches [blocks, bs, Hkv, D] of `kind` (fp8: with their scales, turbo: with
// their lengths, else NULL; turbo: `bits` and `levels` too, and q and out in its rotated frame),
// tables [B, table_stride] int32, lens [B] int32, out [B, Hq, D].
void xinfer_paged_decode(const float *q, int64_t q_ld, void *kc, void *vc, float *k_scale, float *v_scale,
                         int kind, const int32_t *tables, int table_stride, const int32_t *lens, float *out, int B,
                         int Hq, int Hkv, int D, int bs, float scale, int window, float softcap, int bits,
                         const float *levels) {
    const xq_kv k = {kc, k_scale, kind, bits, levels, NULL, NULL, NULL};
    const xq_kv v = {vc, v_scale, kind, bits, levels, NULL, NULL, NULL};
    const int S = attn_splits(B, max_len(lens, B));
    float *part = S > 1 ? malloc(sizeof(float) * (size_t)B * Hq * S * (D + 2)) : NULL;
    int counter;  // attend_team's, shared by the team
#pragma omp parallel
    attend_team(q, q_ld, &k, &v, tables, table_stride, lens, out, B, Hq, Hkv, D, bs, scale, window,
                softcap, S, part, &counter);
    free(part);
}

// Prefill attention straight from the paged cache: each query row of a chunk over the positions up
// to its own (and within the window). One work item is (sequence, KV head, tile of VW query rows),
// for the KV head's query heads: the rows are the lanes of a vector, so scores and the online softmax run lane-wise (no
// horizontal sums) and each K or V value is broadcast from its row to the VW rows at once. Keys come
// a span at a time: its scores (8 keys a pass, each transposed query value loaded once for the 8),
// one softmax update, then P.V in tiles of PF_DT output values held in registers over the span.
// About 2 D FMAs of VW lanes a (key, tile): 3x torch's SDPA on 256-token prompts (bench/NOTES-cpu.md).
#if VW == 16
#define PF_DT 16
static inline vf v_lanes(vf v, int lo, int hi, float fill) {  // lanes lo .. hi - 1 kept, the rest `fill`
    lo = lo < 0 ? 0 : lo > VW ? VW : lo, hi = hi < lo ? lo : hi > VW ? VW : hi;
    return _mm512_mask_blend_ps((__mmask16)(((1u << hi) - 1) & ~((1u << lo) - 1)), _mm512_set1_ps(fill), v);
}
#else
#define PF_DT 8
static inline vf v_lanes(vf v, int lo, int hi, float fill) {
    const __m256i r = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i keep = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), r),
                                             _mm256_cmpgt_epi32(_mm256_set1_epi32(hi), r));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(keep));
}
#endif

// Row pointers of positions c0 .. c0 + n - 1 of KV head h: the cache's own rows (float32), else the
// rows converted and scaled into buf (n * D floats).
static void span_rows(const xq_kv *c, const int32_t *tab, int c0, int n, int bs, int Hkv, int h, int D, float *buf,
                      const float **rows) {
    int blk = c0 / bs, off = c0 % bs;  // one division a span, not one a row
    for (int j = 0; j < n; j++) {
        const size_t r = ((size_t)tab[blk] * bs + off) * Hkv + h;
        if (++off == bs) off = 0, blk++;
        if (c->kind == KV_F32) {
            rows[j] = (const float *)c->data + r * D;
            continue;
        }
        float *dst = buf + (size_t)j * D;
        const float *src = kv_row(c, r, D, dst), s = kv_scale(c, r);
        if (s != 1.f || src != dst)
            for (int i = 0; i < D; i++) dst[i] = src[i] * s;
        rows[j] = dst;
    }
}

// Scores of keys k[0 .. NK - 1] for the tile's lanes: s[j] = sum_d k[j][d] qt[d] (qt: [D][VW]).
#define PF_QK(NK)                                                                                   \
    static inline __attribute__((always_inline)) void pf_qk##NK(const float *qt, const float *const *k, float *s, \
                                                               int D) {                             \
        vf a[NK];                                                                                   \
        for (int j = 0; j < NK; j++) a[j] = v_zero();                                               \
        for (int d = 0; d < D; d++) {                                                               \
            const vf qd = v_load(qt + (size_t)d * VW);                                              \
            for (int j = 0; j < NK; j++) a[j] = v_fma(v_set1(k[j][d]), qd, a[j]);                   \
        }                                                                                           \
        for (int j = 0; j < NK; j++) v_store(s + (size_t)j * VW, a[j]);                             \
    }
PF_QK(8)
PF_QK(1)
#undef PF_QK

// ot [D][VW] += sum over the span's n keys of p[j] (VW lanes) * v[j][d], PF_DT values of d at a time.
static inline void pf_pv(float *ot, const float *p, const float *const *v, int n, int D) {
    for (int d0 = 0; d0 < D; d0 += PF_DT) {
        vf a[PF_DT];
        for (int i = 0; i < PF_DT; i++) a[i] = v_load(ot + (size_t)(d0 + i) * VW);
        for (int j = 0; j < n; j++) {
            const vf pj = v_load(p + (size_t)j * VW);
            const float *vj = v[j] + d0;
            for (int i = 0; i < PF_DT; i++) a[i] = v_fma(pj, v_set1(vj[i]), a[i]);
        }
        for (int i = 0; i < PF_DT; i++) v_store(ot + (size_t)(d0 + i) * VW, a[i]);
    }
}

typedef struct {  // one thread's scratch, for G heads of D floats
    float *qt, *ot, *m, *l, *s, *kbuf, *vbuf;
    const float **krows, **vrows;
} pf_scratch;

#if VW == 16
// exp(x) for x <= 0 to ~4e-5 relative (2^f, |f| <= 1/2, by its degree-4 Taylor polynomial): for
// probabilities rounded to bfloat16 (2^-9) after, at 9 operations where v_exp takes 15.
static inline vf v_exp_bf16(vf x) {
    const vf t = v_mul(v_max(x, v_set1(-87.3f)), v_set1(1.44269504088896341f)), n = v_round(t), f = v_sub(t, n);
    vf p = v_set1(9.6181291e-3f);
    p = v_fma(p, f, v_set1(5.5504109e-2f));
    p = v_fma(p, f, v_set1(2.4022651e-1f));
    p = v_fma(p, f, v_set1(6.9314718e-1f));
    return v_pow2(v_fma(p, f, v_set1(1.f)), n);
}
#else
#define v_exp_bf16 v_exp  // the AVX2 build has no bfloat16 tile
#endif

// One online-softmax update of a tile's lanes over a span's n keys from c0 (scores s [n][VW], left as
// the probabilities): the running max m and sum l of the VW query rows (the first at position p0),
// and their outputs ot [D][VW] rescaled. `bf16`: the probabilities are to be rounded to bfloat16.
static inline __attribute__((always_inline)) void pf_softmax(float *s, int n, int c0, int p0, int last, int window,
                                                             float softcap, float *m_, float *l_, float *ot, int D,
                                                             int bf16) {
    // key t is seen by lanes r with t <= p0 + r (causal) and t > p0 + r - window
    const int masked = c0 + n - 1 > p0 || (window > 0 && c0 <= last - window);
    const vf m = v_load(m_);
    vf mx = m;
    for (int j = 0; j < n; j++) {
        vf x = v_load(s + (size_t)j * VW);
        if (softcap > 0.f) {
            float t[VW];
            v_store(t, x);
            for (int r = 0; r < VW; r++) t[r] = softcap * tanhf(t[r] / softcap);
            x = v_load(t);
        }
        if (masked) x = v_lanes(x, c0 + j - p0, window > 0 ? c0 + j - p0 + window : VW, -INFINITY);
        if (masked || softcap > 0.f) v_store(s + (size_t)j * VW, x);
        mx = v_max(mx, x);
    }
    const vf alpha = v_exp(v_sub(m, mx));
    vf tot = v_zero();
    for (int j = 0; j < n; j++) {
        const vf x = v_sub(v_load(s + (size_t)j * VW), mx);
        vf e = bf16 ? v_exp_bf16(x) : v_exp(x);
        if (masked) e = v_lanes(e, c0 + j - p0, window > 0 ? c0 + j - p0 + window : VW, 0.f);  // v_exp's floor
        v_store(s + (size_t)j * VW, e);
        tot = v_add(tot, e);
    }
    v_store(l_, v_add(v_mul(v_load(l_), alpha), tot));
    v_store(m_, mx);
    for (int d = 0; d < D; d++) v_store(ot + (size_t)d * VW, v_mul(v_load(ot + (size_t)d * VW), alpha));
}

// nr <= VW query rows, the first at position p0 (the rest follow), of the G query heads of KV head h:
// q rows `qld` floats apart and out rows `ld`, both offset to the first of those heads. Each span's K and V rows are
// found (and converted, for a cache not in float32) once for the G heads.
static void pf_tile(const float *q, size_t qld, float *out, size_t ld, int nr, int p0, const xq_kv *kc, const xq_kv *vc,
                    const int32_t *tab, int h, int G, int Hkv, int D, int bs, float scale, int window, float softcap,
                    pf_scratch *w) {
    const size_t hv = (size_t)D * VW;  // one head's transposed queries or outputs
    for (int g = 0; g < G; g++) {
        float *qt = w->qt + g * hv;
        for (int d = 0; d < D; d++)
            for (int r = 0; r < VW; r++) qt[(size_t)d * VW + r] = r < nr ? q[(size_t)r * qld + (size_t)g * D + d] * scale : 0.f;
        v_store(w->m + (size_t)g * VW, v_set1(-FLT_MAX));
        v_store(w->l + (size_t)g * VW, v_zero());
    }
    memset(w->ot, 0, sizeof(float) * G * hv);
    const int last = p0 + nr - 1, lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    for (int c0 = lo; c0 <= last; c0 += SPAN) {
        const int n = last + 1 - c0 < SPAN ? last + 1 - c0 : SPAN;
        span_rows(kc, tab, c0, n, bs, Hkv, h, D, w->kbuf, w->krows);
        span_rows(vc, tab, c0, n, bs, Hkv, h, D, w->vbuf, w->vrows);
        for (int g = 0; g < G; g++) {
            float *s = w->s, *ot = w->ot + g * hv;
            int j = 0;
            for (; j + 8 <= n; j += 8) pf_qk8(w->qt + g * hv, w->krows + j, s + (size_t)j * VW, D);
            for (; j < n; j++) pf_qk1(w->qt + g * hv, w->krows + j, s + (size_t)j * VW, D);
            pf_softmax(s, n, c0, p0, last, window, softcap, w->m + (size_t)g * VW, w->l + (size_t)g * VW, ot, D, 0);
            pf_pv(ot, s, w->vrows, n, D);
        }
    }
    for (int g = 0; g < G; g++) {
        const float *ot = w->ot + g * hv, *l = w->l + (size_t)g * VW;
#if VW == 16  // rows from lanes, 16 values of d at a time
        float inv[VW];
        for (int r = 0; r < VW; r++) inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512i t[16];
            for (int k = 0; k < 16; k++) t[k] = _mm512_loadu_si512(ot + (size_t)(d0 + k) * VW);
            transpose16(t);
            for (int r = 0; r < nr; r++) v_store(out + (size_t)r * ld + (size_t)g * D + d0, v_mul((vf)t[r], v_set1(inv[r])));
        }
#else
        for (int r = 0; r < nr; r++) {
            const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
            for (int d = 0; d < D; d++) out[(size_t)r * ld + (size_t)g * D + d] = ot[(size_t)d * VW + r] * inv;
        }
#endif
    }
}

#if defined(__AVX512BF16__)
// acc += v . the pair at p broadcast to every lane: one instruction with its memory operand (gcc
// otherwise loads the broadcast into a register first).
static inline __attribute__((always_inline)) __m512 dp_bcast(__m512 acc, __m512bh v, const void *p) {
    __asm__("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*(const uint32_t *)p));
    return acc;
}

static inline __attribute__((always_inline)) void pf_qk8_bf16(const uint32_t *qt, const uint16_t *kb, const size_t *at,
                                                              float *s, int DP) {
    vf a[8];
    for (int j = 0; j < 8; j++) a[j] = v_zero();
    for (int p = 0; p < DP; p++) {
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qt + (size_t)p * 16);
        for (int j = 0; j < 8; j++) a[j] = dp_bcast(a[j], qv, kb + at[j] + 2 * p);
    }
    for (int j = 0; j < 8; j++) v_store(s + (size_t)j * VW, a[j]);
}

// pf_tile for a bfloat16 cache on the dot-product units, its K and V rows read where they lie (no
// conversion). The tile's queries (times the scale) and its probabilities are rounded to bfloat16, so
// a (key, tile) costs D vdpbf16ps of 16 lanes where pf_tile's float32 FMAs took 2 D and a conversion
// of the rows (decode keeps float32's precision with hi + lo halves: it is bound by reading K and V,
// prefill by these products; a speculative step's verified rows run as decode rows, AttnMetadata.is_short).
// Scores: lane r of qt[g][p] holds row r's pair p; each key's pair is broadcast. P.V: keys j, j + 1
// interleaved (vt: their pair of values for each d, in the unpacks' order) against the lanes' pair of
// probabilities (pp).
static void pf_tile_bf16(const float *q, size_t qld, float *out, size_t ld, int nr, int p0, const xq_kv *kc,
                         const xq_kv *vc, const int32_t *tab, int h, int G, int Hkv, int D, int bs, float scale,
                         int window, float softcap, pf_scratch *w) {
    const int DP = D / 2;
    const size_t hv = (size_t)D * VW;
    uint32_t *qt = (uint32_t *)w->qt;  // [G][DP][16]: pair p of the 16 rows
    uint32_t *vt = (uint32_t *)w->kbuf;  // [SPAN / 2][D] pairs of values
    uint32_t *pp = (uint32_t *)w->vbuf;  // [SPAN / 2][16] pairs of probabilities
    size_t at[SPAN];
    const vf sv = v_set1(scale);
    for (int g = 0; g < G; g++) {
        for (int p0_ = 0; p0_ < DP; p0_ += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; j++) {
                const float *x = q + (size_t)j * qld + (size_t)g * D + 2 * p0_;
                r[j] = j < nr ? (__m512i)_mm512_cvtne2ps_pbh(v_mul(v_load(x + 16), sv), v_mul(v_load(x), sv))
                              : _mm512_setzero_si512();
            }
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(qt + ((size_t)g * DP + p0_ + c) * 16, r[c]);
        }
        v_store(w->m + (size_t)g * VW, v_set1(-FLT_MAX));
        v_store(w->l + (size_t)g * VW, v_zero());
    }
    memset(w->ot, 0, sizeof(float) * G * hv);
    const uint16_t *kb = (const uint16_t *)kc->data + (size_t)h * D, *vb = (const uint16_t *)vc->data + (size_t)h * D;
    static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i ileave = _mm512_loadu_si512(order);  // lane r: (key 2j, key 2j + 1)
    const int last = p0 + nr - 1, lo = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    for (int c0 = lo; c0 <= last; c0 += SPAN) {
        const int n = last + 1 - c0 < SPAN ? last + 1 - c0 : SPAN, np = (n + 1) / 2;
        bf16_span_rows(tab, c0, n, bs, Hkv, D, at);  // padded to whole chunks with row n - 1
        for (int j = 0; j < np; j++) {
            const uint16_t *a = vb + at[2 * j], *b = vb + at[2 * j + 1];
            for (int i = 0; i < D; i += 32) {
                const __m512i x = _mm512_loadu_si512(a + i), y = _mm512_loadu_si512(b + i);
                _mm512_storeu_si512(vt + (size_t)j * D + i, _mm512_unpacklo_epi16(x, y));
                _mm512_storeu_si512(vt + (size_t)j * D + i + 16, _mm512_unpackhi_epi16(x, y));
            }
        }
        for (int g = 0; g < G; g++) {
            float *s = w->s, *ot = w->ot + g * hv;
            for (int j = 0; j < n; j += 8) pf_qk8_bf16(qt + (size_t)g * DP * 16, kb, at + j, s + (size_t)j * VW, DP);
            pf_softmax(s, n, c0, p0, last, window, softcap, w->m + (size_t)g * VW, w->l + (size_t)g * VW, ot, D, 1);
            for (int j = 0; j < np; j++) {
                const vf b = 2 * j + 1 < n ? v_load(s + (size_t)(2 * j + 1) * VW) : v_zero();
                _mm512_storeu_si512(pp + (size_t)j * 16, _mm512_permutexvar_epi16(ileave, (__m512i)_mm512_cvtne2ps_pbh(b, v_load(s + (size_t)2 * j * VW))));
            }
            for (int d0 = 0; d0 < D; d0 += 16) {
                vf a[16];
                for (int i = 0; i < 16; i++) a[i] = v_load(ot + (size_t)(d0 + i) * VW);
                for (int j = 0; j < np; j++) {
                    const __m512bh pj = (__m512bh)_mm512_loadu_si512(pp + (size_t)j * 16);
                    for (int i = 0; i < 16; i++)
                        a[i] = dp_bcast(a[i], pj, vt + (size_t)j * D + d0 + i);
                }
                for (int i = 0; i < 16; i++) v_store(ot + (size_t)(d0 + i) * VW, a[i]);
            }
        }
    }
    // each 32 slots back to their d (the unpacks' order, as pv_bf16 puts it back), rows from lanes
    const __m512i lo_d = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_d = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int g = 0; g < G; g++) {
        const float *ot = w->ot + g * hv, *l = w->l + (size_t)g * VW;
        float inv[VW];
        for (int r = 0; r < VW; r++) inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
        for (int i = 0; i < D; i += 32) {
            __m512i a[16], b[16];
            for (int k = 0; k < 16; k++)
                a[k] = _mm512_loadu_si512(ot + (size_t)(i + k) * VW), b[k] = _mm512_loadu_si512(ot + (size_t)(i + 16 + k) * VW);
            transpose16(a), transpose16(b);
            for (int r = 0; r < nr; r++) {
                float *o = out + (size_t)r * ld + (size_t)g * D + i;
                const vf x = (vf)a[r], y = (vf)b[r], iv = v_set1(inv[r]);
                v_store(o, v_mul(_mm512_permutex2var_ps(x, lo_d, y), iv));
                v_store(o + 16, v_mul(_mm512_permutex2var_ps(x, hi_d, y), iv));
            }
        }
    }
}
#endif

// B prefill sequences: sequence b's q_lens[b] query rows start at row q_starts[b] of q [T, Hq, D] (rows
// q_ld floats apart: a view into the QKV projection's output) and of out [T, Hq, D], its last at
// position kv_lens[b] - 1; tables [B, table_stride]. The caches and the other arguments as
// xinfer_paged_decode's (turbo: q and out in its rotated frame).
void xinfer_paged_prefill(const float *q, int64_t q_ld, void *kc, void *vc, float *k_scale, float *v_scale, int kind,
                          const int32_t *tables, int table_stride, const int32_t *q_starts, const int32_t *q_lens,
                          const int32_t *kv_lens, float *out, int B, int Hq, int Hkv, int D, int bs, float scale,
                          int window, float softcap, int bits, const float *levels) {
    const xq_kv k = {kc, k_scale, kind, bits, levels, NULL, NULL, NULL};
    const xq_kv v = {vc, v_scale, kind, bits, levels, NULL, NULL, NULL};
    const int G = Hq / Hkv;
#if defined(__AVX512BF16__)
    const int on_dp = kind == KV_BF16 && (D == 64 || D == 128);  // pf_tile_bf16
#endif
    int items = 0;
    for (int b = 0; b < B; b++) items += (q_lens[b] + VW - 1) / VW * Hkv;
    const size_t ld = (size_t)Hq * D;
    // each pool thread's scratch, kept across calls (past 128 KB a fresh one is mapped and faulted in each time)
    static __thread float *mem;
    static __thread size_t cap;
    static __thread const float *rows[2 * SPAN];
    const size_t need = (size_t)G * (2 * D + 2) * VW + (size_t)SPAN * VW + (size_t)2 * SPAN * D;
#pragma omp parallel
    {
        pf_scratch w;
        if (need > cap) free(mem), mem = malloc(sizeof(float) * need), cap = need;
        w.qt = mem, w.ot = w.qt + (size_t)G * D * VW, w.m = w.ot + (size_t)G * D * VW, w.l = w.m + (size_t)G * VW;
        w.s = w.l + (size_t)G * VW, w.kbuf = w.s + (size_t)SPAN * VW, w.vbuf = w.kbuf + (size_t)SPAN * D;
        w.krows = rows, w.vrows = rows + SPAN;
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            int b = 0, rest = it, per;
            while (rest >= (per = (q_lens[b] + VW - 1) / VW * Hkv)) rest -= per, b++;
            const int tiles = per / Hkv, tile = tiles - 1 - rest / Hkv, h = rest % Hkv;  // the longest tiles first
            const int r0 = tile * VW, nr = q_lens[b] - r0 < VW ? q_lens[b] - r0 : VW;
            const size_t row = (size_t)q_starts[b] + r0, head = (size_t)h * G * D;
#if defined(__AVX512BF16__)
            if (on_dp) {
                pf_tile_bf16(q + row * q_ld + head, (size_t)q_ld, out + row * ld + head, ld, nr, kv_lens[b] - q_lens[b] + r0,
                             &k, &v, tables + (size_t)b * table_stride, h, G, Hkv, D, bs, scale, window, softcap, &w);
                continue;
            }
#endif
            pf_tile(q + row * q_ld + head, (size_t)q_ld, out + row * ld + head, ld, nr, kv_lens[b] - q_lens[b] + r0, &k, &v,
                    tables + (size_t)b * table_stride, h, G, Hkv, D, bs, scale, window, softcap, &w);
        }
    }
}


// out [T, I] = silu(gate) * up for rows [gate | up] of gu [T, 2 I] (a gate/up projection's output):
// float32, or bfloat16 in and out (computed in float32, rounded once). I a multiple of VW.
void xinfer_silu_mul(const void *gu, void *out, int T, int I, int bf16) {
#pragma omp parallel for schedule(static) if ((size_t)T * I > 65536)
    for (int t = 0; t < T; t++) {
        if (!bf16) {
            const float *g = (const float *)gu + (size_t)t * 2 * I;
            silu_mul(g, g + I, (float *)out + (size_t)t * I, I);
            continue;
        }
        const uint16_t *g = (const uint16_t *)gu + (size_t)t * 2 * I, *u = g + I;
        uint16_t *o = (uint16_t *)out + (size_t)t * I;
        for (int i = 0; i < I; i += VW) {
            const vf x = bf16_load(g + i), e = v_exp(v_neg_abs(x));
            const vf sig = v_div(v_if_neg(x, e, v_set1(1.f)), v_add(v_set1(1.f), e));
            bf16_store(o + i, v_mul(v_mul(x, sig), bf16_load(u + i)));
        }
    }
}

// residual += x (when residual is given), then out = w * (r / sqrt(mean(r^2) + eps)) per row of H,
// with w + offset for Gemma's (1 + w) scaling: RMSNorm in float32, with the residual add fused. x
// and out float32, or bfloat16 where xb / ob (the output of a bfloat16 GEMM widened exactly; the
// input of one rounded once, as the casts around a float32 norm would): the same numbers without
// the casts. The sum of squares in VW lanes (torch's order is its own too).
static void add_rmsnorm_row(const void *x, int xb, float *rr, const float *w, void *o, int ob, int H, float eps,
                            float offset) {
    const float *xf = x;
    const uint16_t *xh = x;
    vf acc = v_zero();
    int i = 0;
    for (; i + VW <= H; i += VW) {
        vf r = xb ? bf16_load(xh + i) : v_load(xf + i);
        if (rr) r = v_add(v_load(rr + i), r), v_store(rr + i, r);
        acc = v_add(acc, v_mul(r, r));
    }
    float ss = hsum(acc);
    for (; i < H; i++) {
        float r = xb ? bf16_f32(xh[i]) : xf[i];
        if (rr) r = rr[i] + r, rr[i] = r;
        ss += r * r;
    }
    const float inv = 1.f / sqrtf(ss / H + eps);
    const vf iv = v_set1(inv), off = v_set1(offset);
    for (i = 0; i + VW <= H; i += VW) {
        const vf r = rr ? v_load(rr + i) : xb ? bf16_load(xh + i) : v_load(xf + i);
        const vf y = v_mul(v_add(v_load(w + i), off), v_mul(r, iv));
        if (ob) bf16_store((uint16_t *)o + i, y);
        else v_store((float *)o + i, y);
    }
    for (; i < H; i++) {
        const float y = (w[i] + offset) * ((rr ? rr[i] : xb ? bf16_f32(xh[i]) : xf[i]) * inv);
        if (ob) ((uint16_t *)o)[i] = f32_bf16(y);
        else ((float *)o)[i] = y;
    }
}

void xinfer_add_rmsnorm(const void *x, int xb, float *residual, const float *w, void *out, int ob, int T, int H,
                        float eps, float offset) {
    const size_t xs = (size_t)H * (xb ? 2 : 4), os = (size_t)H * (ob ? 2 : 4);
#pragma omp parallel for schedule(static) if (T > 4)
    for (int t = 0; t < T; t++)
        add_rmsnorm_row((const char *)x + t * xs, xb, residual ? residual + (size_t)t * H : NULL, w,
                        (char *)out + t * os, ob, H, eps, offset);
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
    // a prompt's rows split among the threads: alone, the rest of the team waited (~2% of a prefill step)
#pragma omp parallel if (T >= 64)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int t0 = (int)((int64_t)T * id / nt), t1 = (int)((int64_t)T * (id + 1) / nt);
        rope_rows(q + (size_t)t0 * q_stride, q_stride, Hq, D, rot, cos, sin, pos + t0, t1 - t0);
        rope_rows(k + (size_t)t0 * k_stride, k_stride, Hk, D, rot, cos, sin, pos + t0, t1 - t0);
    }
}

// ---- One decode step of a Llama-shaped decoder, every layer in one call ----
// A step of B sequences with one new token each spends most of its time outside the matmuls when
// each op is a torch call (~300 a step); here the whole stack runs in one OpenMP region, with a
// barrier between dependent ops. The math is the torch path's, op for op: the same kernels above,
// RMSNorm with the residual add, rotary, the K/V store, silu(gate) * up.
typedef struct {
    const float *ln_in, *ln_post, *q_norm, *k_norm;  // q_norm / k_norm: NULL where the model has none
    const float *attn_out_norm, *mlp_out_norm;  // Gemma 3's norms of each sublayer's output; else NULL
    xq_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;  // [blocks, bs, Hkv, D] of kv_kind (xq_kv)
    float *k_scale, *v_scale;  // fp8: [blocks, bs, Hkv]; turbo: its float16 lengths; else NULL
    const float *levels, *mids, *rotation, *k_shift;  // turbo (xq_kv); else NULL
    int kv_bits;
    const float *cos, *sin;    // [positions, rot / 2]
    int rot, window, kv_kind;
    int act;  // 0: silu(gate) * up; 1: gelu_tanh(gate) * up
    float scale, softcap;
} xq_layer;

typedef struct {
    int n_layers, H, Hq, Hkv, D, inter, bs;
    float eps, offset;  // every RMSNorm's
    const float *final_norm;
    const xq_layer *layers;
} xq_model;

// The next layer's K and V rows, fetched toward L2 during this layer's gate/up matmul (compute-
// bound for a few sequences): a few sequences' attention otherwise waits on memory at every chunk,
// their cache having left L3 while the weights streamed through. Each thread takes an even share
// of the lines (K then V of each block, sequence after sequence), PF_MAX_BYTES in all at most; past
// that, with one range a sequence, the first span of the sequence the thread attends first.
#define PF_MAX_BYTES (1u << 20)
struct kv_pf {
    const char *k, *v;
    const int32_t *tables, *lens;
    int stride, bs, b, j;
    size_t lpb, block_bytes, line, left, per;  // lpb: lines a block of one cache
};

static void pf_init(kv_pf *p, const xq_layer *L, const int32_t *tables, int stride, const int32_t *lens, int B,
                    int bs, int Hkv, int D, int iters) {
    p->left = 0;
    const size_t el = kv_elem_bytes(L->kv_kind);
    if (!el) return;  // turbo rows are packed differently: not fetched
    p->k = L->k_cache, p->v = L->v_cache, p->tables = tables, p->lens = lens, p->stride = stride, p->bs = bs;
    p->block_bytes = (size_t)bs * Hkv * D * el, p->lpb = (p->block_bytes + 63) / 64;
    const int T = omp_get_num_threads(), t = omp_get_thread_num();
    size_t total = 0;
    for (int b = 0; b < B; b++) total += (size_t)(lens[b] + bs - 1) / bs * 2 * p->lpb;
    if (total > PF_MAX_BYTES / 64 && B >= 2 * T) {
        // not all: with one range a sequence, thread t's first is sequence t (attend_team), and each
        // span fetches the next; so its first span (window or not: the lines are only a guess)
        const int blocks = t < B ? ((lens[t] < SPAN ? lens[t] : SPAN) + bs - 1) / bs : 0;
        p->b = t, p->j = 0, p->line = 0, p->left = (size_t)blocks * 2 * p->lpb;
        p->per = (p->left + iters - 1) / (iters > 0 ? iters : 1);
        return;
    }
    if (total > PF_MAX_BYTES / 64) total = PF_MAX_BYTES / 64;
    size_t skip = total * t / T;
    p->left = total * (t + 1) / T - skip, p->per = (p->left + iters - 1) / (iters > 0 ? iters : 1);
    for (p->b = 0; p->b < B; p->b++) {  // find this thread's first line
        const size_t n = (size_t)(lens[p->b] + bs - 1) / bs * 2 * p->lpb;
        if (skip < n) break;
        skip -= n;
    }
    p->j = (int)(skip / (2 * p->lpb)), p->line = skip % (2 * p->lpb);
}

static void pf_step(kv_pf *p) {
    for (size_t k = 0; k < p->per && p->left; k++, p->left--) {
        const int32_t blk = p->tables[(size_t)p->b * p->stride + p->j];
        const int v = p->line >= p->lpb;
        _mm_prefetch((v ? p->v : p->k) + (size_t)blk * p->block_bytes + (p->line - (v ? p->lpb : 0)) * 64, _MM_HINT_T1);
        if (++p->line == 2 * p->lpb) {
            p->line = 0;
            if (++p->j == (p->lens[p->b] + p->bs - 1) / p->bs) p->j = 0, p->b++;
        }
    }
}

static void head_norm(float *x, const float *w, int H, int D, float eps, float offset) {
    for (int h = 0; h < H; h++) add_rmsnorm_row(x + (size_t)h * D, 0, NULL, w, x + (size_t)h * D, 0, D, eps, offset);
}

// x [B, H]: the embedded tokens; out [B, H]: the final norm's output (the head's input). pos,
// slots [B] int64: each token's position and KV slot; tables [B, table_stride], lens [B] int32 as in
// xinfer_paged_decode.
void xinfer_decode(const xq_model *m, const float *x, float *out, int B, const int64_t *pos, const int64_t *slots,
                   const int32_t *tables, int table_stride, const int32_t *lens) {
    const int H = m->H, D = m->D, Hq = m->Hq, Hkv = m->Hkv, I = m->inter, QKV = (Hq + 2 * Hkv) * D;
    float *res = malloc(sizeof(float) * (size_t)B * H), *h = malloc(sizeof(float) * (size_t)B * H);
    float *y = malloc(sizeof(float) * (size_t)B * H), *qkv = malloc(sizeof(float) * (size_t)B * QKV);
    float *att = malloc(sizeof(float) * (size_t)B * Hq * D), *gu = malloc(sizeof(float) * (size_t)B * 2 * I);
    float *act = malloc(sizeof(float) * (size_t)B * I);
    const int S = attn_splits(B, max_len(lens, B));  // decode attention's position ranges
    float *part = S > 1 ? malloc(sizeof(float) * (size_t)B * Hq * S * (D + 2)) : NULL;
    int counter;  // attend_team's, shared by the team
    memcpy(y, x, sizeof(float) * (size_t)B * H);
#pragma omp parallel
    {
        for (int l = 0; l < m->n_layers; l++) {
            const xq_layer *L = &m->layers[l];
            const int warm = l > 0 && kv_bytes(lens, B, m->bs, Hkv, D, L->kv_kind) <= PF_MAX_BYTES;  // all fetched
            const xq_kv kc = {L->k_cache, L->k_scale, L->kv_kind, L->kv_bits, L->levels, L->mids, L->rotation,
                              L->k_shift, warm};
            const xq_kv vc = {L->v_cache, L->v_scale, L->kv_kind, L->kv_bits, L->levels, L->mids, L->rotation, NULL,
                              warm};
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                add_rmsnorm_row(y + (size_t)b * H, 0, l ? res + (size_t)b * H : NULL, L->ln_in, h + (size_t)b * H, 0, H,
                                m->eps, m->offset);
                if (l == 0) memcpy(res + (size_t)b * H, y + (size_t)b * H, sizeof(float) * H);  // its residual is its input
            }
            mm_team(&L->qkv, h, qkv, B, NULL, NULL);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                float *qb = qkv + (size_t)b * QKV, *kb = qb + (size_t)Hq * D, *vb = kb + (size_t)Hkv * D;
                if (L->q_norm) {
                    head_norm(qb, L->q_norm, Hq, D, m->eps, m->offset);
                    head_norm(kb, L->k_norm, Hkv, D, m->eps, m->offset);
                }
                rope_rows(qb, QKV, Hq, D, L->rot, L->cos, L->sin, pos + b, 1);
                rope_rows(kb, QKV, Hkv, D, L->rot, L->cos, L->sin, pos + b, 1);
                kv_write(&kc, (size_t)slots[b] * Hkv, kb, Hkv, D);
                kv_write(&vc, (size_t)slots[b] * Hkv, vb, Hkv, D);
                if (L->kv_kind == KV_TURBO) rotate_heads(L->rotation, qb, Hq, D, 0);  // into the cache's frame
            }
            attend_team(qkv, QKV, &kc, &vc, tables, table_stride, lens, att, B, Hq, Hkv, D, m->bs, L->scale,
                        L->window, L->softcap, S, part, &counter);
            if (L->kv_kind == KV_TURBO) {
#pragma omp for schedule(static)
                for (int b = 0; b < B; b++) rotate_heads(L->rotation, att + (size_t)b * Hq * D, Hq, D, 1);  // and back
            }
            mm_team(&L->o, att, y, B, NULL, NULL);
#pragma omp for schedule(static)
            for (int b = 0; b < B; b++) {
                if (L->attn_out_norm)
                    add_rmsnorm_row(y + (size_t)b * H, 0, NULL, L->attn_out_norm, y + (size_t)b * H, 0, H, m->eps, m->offset);
                add_rmsnorm_row(y + (size_t)b * H, 0, res + (size_t)b * H, L->ln_post, h + (size_t)b * H, 0, H, m->eps,
                                m->offset);
            }
            kv_pf pf;
            if (l + 1 < m->n_layers)
                pf_init(&pf, &m->layers[l + 1], tables, table_stride, lens, B, m->bs, Hkv, D,
                        (L->gate_up.N + omp_get_num_threads() - 1) / omp_get_num_threads());
            const int fused = mm_team(&L->gate_up, h, gu, B, l + 1 < m->n_layers ? &pf : NULL,
                                      L->act || I % 16 ? NULL : act);  // silu(gate) * up made with them
            if (!fused && L->act) {
#pragma omp for schedule(static)
                for (int j = 0; j < B * I; j++) {
                    const float g = gu[(size_t)(j / I) * 2 * I + j % I], u = gu[(size_t)(j / I) * 2 * I + I + j % I];
                    act[j] = 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
                }
            } else if (!fused) {
                const int CH = 128, nc = (I + CH - 1) / CH;  // chunks: both threads share even one row
#pragma omp for schedule(static)
                for (int t = 0; t < B * nc; t++) {
                    const int b = t / nc, i = t % nc * CH;
                    const float *g = gu + (size_t)b * 2 * I + i;
                    silu_mul(g, g + I, act + (size_t)b * I + i, I - i < CH ? I - i : CH);
                }
            }
            mm_team(&L->down, act, y, B, NULL, NULL);
            if (L->mlp_out_norm) {
#pragma omp for schedule(static)
                for (int b = 0; b < B; b++)
                    add_rmsnorm_row(y + (size_t)b * H, 0, NULL, L->mlp_out_norm, y + (size_t)b * H, 0, H, m->eps, m->offset);
            }
        }
#pragma omp for schedule(static)
        for (int b = 0; b < B; b++)
            add_rmsnorm_row(y + (size_t)b * H, 0, res + (size_t)b * H, m->final_norm, out + (size_t)b * H, 0, H, m->eps,
                            m->offset);
    }
    free(res), free(h), free(y), free(qkv), free(att), free(gu), free(act), free(part);
}
